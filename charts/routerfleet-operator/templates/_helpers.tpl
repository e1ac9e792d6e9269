{{/* The objects' name: the release's when it names the chart, else release-chart. */}}
{{- define "routerfleet-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* What the Deployment selects: one label, stable across upgrades. */}}
{{- define "routerfleet-operator.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
{{- end -}}

{{- define "routerfleet-operator.labels" -}}
{{ include "routerfleet-operator.selector" . }}
{{- if .Values.releaseLabels }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}
{{- end -}}
