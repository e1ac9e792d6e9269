// The Gateway API Inference Extension, pinned (and verified by go.sum) for what the tests take from it:
// its CRDs (e2e/gateway/extension.py).
module routerfleet.io/e2e/gateway

go 1.24

require sigs.k8s.io/gateway-api-inference-extension v1.3.0
