// Package conformance runs the Gateway API Inference Extension's conformance suite, v1.3.0, as
// published: its flags (-gateway-class, -report-output, -run-test, ...) and its manifests.
package conformance

import (
	"testing"

	gie "sigs.k8s.io/gateway-api-inference-extension/conformance"
)

func TestConformance(t *testing.T) {
	gie.RunConformanceWithOptions(t, gie.DefaultOptions(t))
}
