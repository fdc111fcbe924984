{{/* Names, labels, and what head, workers and the trainer share. */}}

{{- define "rollout-farm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's name: the RayService's and the prefix of every other resource. KubeRay rejects a RayService name
over 47 characters or not a DNS-1035 label, so a bad one fails here rather than in the operator.
*/}}
{{- define "rollout-farm.fullname" -}}
{{- $name := "" }}
{{- if .Values.fullnameOverride }}
{{- $name = .Values.fullnameOverride }}
{{- else if contains (include "rollout-farm.name" .) .Release.Name }}
{{- $name = .Release.Name }}
{{- else }}
{{- $name = printf "%s-%s" .Release.Name (include "rollout-farm.name" .) }}
{{- end }}
{{- if gt (len $name) 47 }}
{{- fail (printf "the release name %q is %d characters: KubeRay allows a RayService name of at most 47 (set fullnameOverride)" $name (len $name)) }}
{{- end }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "the release name %q is not a DNS-1035 label (lower case letters, digits and '-', starting with a letter), as KubeRay requires of a RayService name (set fullnameOverride)" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "rollout-farm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rollout-farm.labels" -}}
helm.sh/chart: {{ include "rollout-farm.chart" . }}
{{ include "rollout-farm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "rollout-farm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rollout-farm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels of the Ray Pods. Not app.kubernetes.io/name: KubeRay sets it to "kuberay" on the Pods it creates and a
template label would override it.
*/}}
{{- define "rollout-farm.rayPodLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "rollout-farm.name" . }}
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rollout-farm.serveServiceName" -}}
{{- include "rollout-farm.fullname" . }}-serve-svc
{{- end }}

{{- define "rollout-farm.serveUrl" -}}
http://{{ include "rollout-farm.serveServiceName" . }}:{{ .Values.serve.port | int }}
{{- end }}

{{- define "rollout-farm.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary .Values.gpu.imageSuffix "" .Values.gpu.enabled)) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The token: an existing Secret, or one the chart creates from token.value; nothing else renders. */}}
{{- define "rollout-farm.tokenSecretName" -}}
{{- if and .Values.token.existingSecret .Values.token.value }}
{{- fail "token: give either token.existingSecret (a Secret you manage) or token.value (the chart creates a Secret), not both" }}
{{- else if .Values.token.existingSecret }}
{{- .Values.token.existingSecret }}
{{- else if .Values.token.value }}
{{- if lt (len .Values.token.value) 8 }}
{{- fail "token.value: the API token must be at least 8 characters (the service rejects a shorter FARM_API_TOKEN)" }}
{{- end }}
{{- include "rollout-farm.fullname" . }}-token
{{- else }}
{{- fail "token: set token.existingSecret (the name of a Secret holding FARM_API_TOKEN under token.key) or token.value (at least 8 characters; the chart creates the Secret), e.g. --set token.value=$(openssl rand -hex 16)" }}
{{- end }}
{{- end }}

{{- define "rollout-farm.redisName" -}}
{{- include "rollout-farm.fullname" . }}-redis
{{- end }}

{{/* FARM_REDIS_URL: redis.url, or the in-chart Redis; exactly one. */}}
{{- define "rollout-farm.redisUrl" -}}
{{- if and .Values.redis.url .Values.redis.inChart.enabled }}
{{- fail "redis: give either redis.url (an external Redis) or redis.inChart.enabled=true, not both" }}
{{- else if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.inChart.enabled }}
{{- printf "redis://%s:6379/0" (include "rollout-farm.redisName" .) }}
{{- else }}
{{- fail "redis: the service keeps its state in Redis: set redis.url (e.g. redis://redis.db:6379/0) or redis.inChart.enabled=true" }}
{{- end }}
{{- end }}

{{/* The GCS's Redis as host:port. */}}
{{- define "rollout-farm.gcsRedisAddress" -}}
{{- if .Values.gcsFaultTolerance.redisAddress }}
{{- .Values.gcsFaultTolerance.redisAddress }}
{{- else if .Values.redis.inChart.enabled }}
{{- printf "%s:6379" (include "rollout-farm.redisName" .) }}
{{- else }}
{{- $u := urlParse (include "rollout-farm.redisUrl" .) }}
{{- if not $u.host }}
{{- fail (printf "gcsFaultTolerance: cannot read host:port from redis.url %q; set gcsFaultTolerance.redisAddress" .Values.redis.url) }}
{{- end }}
{{- if contains ":" $u.host }}{{ $u.host }}{{ else }}{{ $u.host }}:6379{{ end }}
{{- end }}
{{- end }}

{{- define "rollout-farm.claimName" -}}
{{- .Values.storage.existingClaim | default (printf "%s-data" (include "rollout-farm.fullname" .)) }}
{{- end }}

{{- define "rollout-farm.weightsDir" -}}
{{- printf "%s/weights" (.Values.storage.mountPath | trimSuffix "/") }}
{{- end }}

{{- define "rollout-farm.cacheDir" -}}
{{- printf "%s/cache" (.Values.storage.mountPath | trimSuffix "/") }}
{{- end }}

{{/* A value as an environment variable's text: strings as they are, the rest as JSON (no 1e+06 for numbers). */}}
{{- define "rollout-farm.envText" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/*
The service's settings (FARM_*), the same on head and workers: the app is built on the head from them, and the
replicas on the workers import the modules that read FARM_CACHE.
*/}}
{{- define "rollout-farm.env" -}}
- name: FARM_APP_NAME
  value: {{ .Values.appName | quote }}
- name: FARM_MODEL
  value: {{ .Values.model | quote }}
- name: FARM_ENGINE
  value: {{ .Values.engine | quote }}
- name: FARM_DEVICE
  value: {{ ternary .Values.gpu.device "cpu" .Values.gpu.enabled | quote }}
{{- if .Values.gpu.enabled }}
- name: FARM_ENGINE_NUM_GPUS
  value: {{ include "rollout-farm.envText" .Values.gpu.perReplica | quote }}
{{- end }}
{{- with .Values.dtype }}
- name: FARM_DTYPE
  value: {{ . | quote }}
{{- end }}
- name: FARM_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: FARM_REPLICAS
  value: {{ .Values.replicas | int | quote }}
- name: FARM_MAX_REPLICAS
  value: {{ ternary (.Values.autoscaling.maxReplicas | int) 0 .Values.autoscaling.enabled | quote }}
{{- if .Values.autoscaling.enabled }}
- name: FARM_TARGET_ONGOING_REQUESTS
  value: {{ include "rollout-farm.envText" .Values.autoscaling.targetOngoingRequests | quote }}
{{- end }}
- name: FARM_INGRESS_REPLICAS
  value: {{ .Values.ingressReplicas | int | quote }}
- name: FARM_HTTP_PROXY
  value: {{ .Values.serve.httpProxy | quote }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" (eq .Values.serve.httpProxy "haproxy") | quote }}
- name: FARM_REDIS_URL
  value: {{ include "rollout-farm.redisUrl" . | quote }}
- name: FARM_WEIGHTS_DIR
  value: {{ include "rollout-farm.weightsDir" . | quote }}
- name: FARM_CACHE
  value: {{ include "rollout-farm.cacheDir" . | quote }}
{{- range $key, $value := .Values.settings }}
- name: {{ printf "FARM_%s" (upper $key) }}
  value: {{ include "rollout-farm.envText" $value | quote }}
{{- end }}
{{ include "rollout-farm.tokenEnv" . }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rollout-farm.tokenEnv" -}}
- name: FARM_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "rollout-farm.tokenSecretName" . }}
      key: {{ .Values.token.key }}
{{- end }}

{{- define "rollout-farm.volumes" -}}
- name: data
  persistentVolumeClaim:
    claimName: {{ include "rollout-farm.claimName" . }}
{{- end }}

{{- define "rollout-farm.volumeMounts" -}}
- name: data
  mountPath: {{ .Values.storage.mountPath }}
{{- end }}

{{/* Scheduling and security shared by Pods: (dict "root" $ "nodeSelector" ... "tolerations" ... "affinity" ...). */}}
{{- define "rollout-farm.podScheduling" -}}
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
{{- end }}

{{- define "rollout-farm.podSecurity" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
