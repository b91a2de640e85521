"""clover.plugins: the tree-attention operator, once per place it runs.

    tree_attention         packed tree masks and the PyTorch reference op (the ground truth)
    triton_tree_attention  the Triton kernel (CUDA; the CPU under TRITON_INTERPRET=1) and its AOT compile to PTX
    onnx_node              the custom ONNX node of `--attention plugin` graphs
    onnx_reference         the node as an ONNX function, so ONNX Runtime checks plugin graphs at export
    trt_plugin             the TensorRT plugin (tensorrt.plugin) that consumes the node

Importing the package imports none of them (they need torch, Triton or TensorRT).
"""
