"""clover.export: torch -> ONNX graphs and the artifact directory (docs/design.md "Exported artifact").

Small loaders, composed by `clover-export` (docs/design.md, Conventions 6):
    config.ExportConfig                    what to make (backend, dtype, opset, tree, max context)
    graphs.base_graph / draft_graphs       flat-signature torch modules + example inputs per graph
    onnx_graph.onnx_from_torch             GraphDef -> <name>.onnx (+ external data), via dynamo
    trace_cache.traced                     the same, from an identical earlier trace where one is kept
    onnx_graph.check_onnx                  onnx.checker + strict shape inference
    compare.parity / compare_artifact      graphs against PyTorch through Polygraphy (export check, clover-compare)
    artifact.artifact_from_modules         modules -> artifact folder (atomic, manifest last)
    artifact.export_artifact               CLI specs (--base, --heads) -> artifact folder
The manifest schema and its validation live in clover.artifact (no torch), shared with the runtime that reads it.
"""
