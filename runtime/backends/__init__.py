"""The engines behind the Runner interface (runtime/backend.py): ONNX Runtime (`ort`) and TensorRT (`trt`) over one
graph runner (`graph`), and PyTorch (`torch`: the per-sequence `torch_runner`, the stacked `torch_batch`). The core
beside this package never imports one of them directly: `backend_module` loads them by name."""
