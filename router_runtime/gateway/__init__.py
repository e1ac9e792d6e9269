"""The gateway plane: RouterFleet as a Gateway's endpoint picker (the Gateway API Inference Extension's
Endpoint Picker protocol over Envoy's external processing, ext_proc). Envoy carries the bytes; the
picker runs the same scheduler as the proxy and tells Envoy where each request goes
(docs/gateway.md)."""
