// Command otelcol is the tests' OpenTelemetry Collector (go.mod says what it holds and why):
//
//	otelcol --config=file:/path/to/config.yaml
//
// The upstream distributions' cmd packages are not go-gettable by their import paths, so this is the
// entry point the collector builder would generate.
package main

import (
	"os"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/otelcol"
)

func main() {
	set := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol",
			Description: "RouterFleet's test collector (OTLP receiver, file exporter)",
			Version:     "0.165.0",
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				// file: for --config; env: because otelcol makes it the default scheme of ${...} and the
				// resolver refuses a default scheme it has no provider for.
				ProviderFactories: []confmap.ProviderFactory{fileprovider.NewFactory(), envprovider.NewFactory()},
			},
		},
	}
	// cobra has already printed the error to stderr; only the exit status is left to set.
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		os.Exit(1)
	}
}
