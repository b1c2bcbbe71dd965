{{/* Names, labels and the pieces every kvmesh pod shares. */}}

{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-kvmesh", or the release name alone when it already says kvmesh. */}}
{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "worker"). */}}
{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvmesh.componentLabels" -}}
{{ include "kvmesh.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvmesh.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "kvmesh.fullname" .)) }}
{{- end }}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* A Service's DNS name: (dict "ctx" $ "service" "scheduler"). */}}
{{- define "kvmesh.serviceHost" -}}
{{- printf "%s-%s.%s.svc.%s" (include "kvmesh.fullname" .ctx) .service .ctx.Release.Namespace .ctx.Values.clusterDomain }}
{{- end }}

{{/* The schedulers' headless Service: one name resolving to every cell. */}}
{{- define "kvmesh.schedulerAddress" -}}
{{- printf "%s:%v" (include "kvmesh.serviceHost" (dict "ctx" . "service" "scheduler")) .Values.scheduler.port }}
{{- end }}

{{- define "kvmesh.usesRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.externalUrl }}true{{ end }}
{{- end }}

{{/* Flags naming the model, shared by workers and frontends. */}}
{{- define "kvmesh.modelArgs" -}}
{{- with .Values.model.path }}
- --model={{ . }}
{{- end }}
{{- with .Values.model.maxModelLen }}
- --max-model-len={{ . }}
{{- end }}
{{- end }}

{{/* An env var read from the chart's Secret: (dict "ctx" $ "name" "X" "key" "k"). */}}
{{- define "kvmesh.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.secretName" .ctx }}
      key: {{ .key }}
{{- end }}

{{/* The internal plane's secret, and the Redis URL (password inside) when
there is a Redis. Services read both from the environment, never from flags. */}}
{{- define "kvmesh.commonEnv" -}}
{{ include "kvmesh.secretEnv" (dict "ctx" . "name" "KVMESH_CLUSTER_SECRET" "key" "cluster-secret") }}
{{- if include "kvmesh.usesRedis" . }}
{{ include "kvmesh.secretEnv" (dict "ctx" . "name" "KVMESH_REDIS_URL" "key" "redis-url") }}
{{- end }}
{{- end }}

{{/* Native gRPC probes on grpc.health.v1: (dict "port" 50051 "probes" .Values.x.probes).
Startup and liveness ask for "liveness" (the process is up and its own
start-up done), readiness for "" (it can serve, peers included): a frontend
whose scheduler is away is taken out of its Service, not restarted. */}}
{{- define "kvmesh.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ .port }}, service: liveness}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  grpc: {port: {{ .port }}}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  grpc: {port: {{ .port }}, service: liveness}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end }}

{{/* Scheduling constraints of a component's pods: (.Values.<component>). */}}
{{- define "kvmesh.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level settings every kvmesh pod shares. */}}
{{- define "kvmesh.podCommon" -}}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{- define "kvmesh.modelVolumeMount" -}}
{{- if .Values.model.volume }}
volumeMounts:
  - name: model
    mountPath: {{ .Values.model.mountPath }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "kvmesh.modelVolume" -}}
{{- if .Values.model.volume }}
volumes:
  - name: model
    {{- toYaml .Values.model.volume | nindent 4 }}
{{- end }}
{{- end }}

{{/* A PodDisruptionBudget: (dict "ctx" $ "component" "worker" "pdb" .Values.worker.podDisruptionBudget). */}}
{{- define "kvmesh.pdb" -}}
{{- if .pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvmesh.fullname" .ctx }}-{{ .component }}
  labels:
    {{- include "kvmesh.componentLabels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}
