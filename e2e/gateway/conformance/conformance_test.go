// Package conformance runs the Gateway API Inference Extension's conformance suite, v1.3.0, as
// published: its flags (-gateway-class, -report-output, -run-test, ...) and its manifests, with one
// addition: -base-manifests names a file to apply in place of the suite's resources/base.yaml (the
// same objects with another endpoint picker in them), read from the directory -manifests-dir.
package conformance

import (
	"flag"
	"io/fs"
	"os"
	"testing"

	gie "sigs.k8s.io/gateway-api-inference-extension/conformance"
)

var (
	manifestsDir  = flag.String("manifests-dir", "", "a directory searched for manifests before the suite's own")
	baseManifests = flag.String("base-manifests", "", "the base manifests' path in -manifests-dir (default: the suite's)")
)

func TestConformance(t *testing.T) {
	opts := gie.DefaultOptions(t)
	if *manifestsDir != "" {
		// The suite reads a path from every file system that has it: a path of our own is read from ours only.
		opts.ManifestFS = append([]fs.FS{os.DirFS(*manifestsDir)}, opts.ManifestFS...)
	}
	if *baseManifests != "" {
		opts.BaseManifests = *baseManifests
	}
	gie.RunConformanceWithOptions(t, opts)
}
