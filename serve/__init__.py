"""clover.serve: the HTTP layer, an OpenAI-compatible ASGI app over clover.Engine, its schemas and Prometheus
metrics. No model code and no torch: it imports only the runtime (docs/design.md "Arrows point one way":
tools -> serve -> runtime)."""
