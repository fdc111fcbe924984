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

{{/* The CPU image (deploy/Dockerfile: the service and the trainer): the helm test Pod, the model download Job, a
trainer without GPUs, and workers and head without gpu.enabled. */}}
{{- define "rollout-farm.cpuImage" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The GPU image (deploy/Dockerfile.gpu: CUDA torch, SGLang, the service and the trainer). */}}
{{- define "rollout-farm.gpuImage" -}}
{{- printf "%s%s" (include "rollout-farm.cpuImage" .) .Values.gpu.imageSuffix }}
{{- end }}

{{- define "rollout-farm.workerImage" -}}
{{- if .Values.gpu.enabled }}{{ include "rollout-farm.gpuImage" . }}{{ else }}{{ include "rollout-farm.cpuImage" . }}{{ end }}
{{- end }}

{{/* The head joins the workers' Ray cluster, and Ray refuses nodes on another Python or Ray: the workers' image,
unless head.cpuImage says the two images share them. */}}
{{- define "rollout-farm.headImage" -}}
{{- if .Values.head.cpuImage }}{{ include "rollout-farm.cpuImage" . }}{{ else }}{{ include "rollout-farm.workerImage" . }}{{ end }}
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

{{/* The Secret holding the Redis password: redis.auth.existingSecret, the chart's for the in-chart Redis, or none. */}}
{{- define "rollout-farm.redisPasswordSecret" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecret }}
{{- else if .Values.redis.inChart.enabled }}{{ include "rollout-farm.redisName" . }}
{{- end }}
{{- end }}

{{/* The Pod env variable the password is read into, for FARM_REDIS_URL's $(...) (not REDIS_PASSWORD: KubeRay
refuses that name on a head with GCS fault tolerance, and sets it itself). */}}
{{- define "rollout-farm.redisPasswordVar" -}}ROLLOUT_FARM_REDIS_PASSWORD{{- end }}

{{/* FARM_REDIS_URL: redis.url, or the in-chart Redis; exactly one. With a password Secret, the password goes in as
$(ROLLOUT_FARM_REDIS_PASSWORD), which Kubernetes fills in from the env variable before it; the URL's query string
(redis-py's options, e.g. ?ssl_cert_reqs=required&socket_timeout=5) is kept. */}}
{{- define "rollout-farm.redisUrl" -}}
{{- $base := "" }}
{{- if and .Values.redis.url .Values.redis.inChart.enabled }}
{{- fail "redis: give either redis.url (an external Redis) or redis.inChart.enabled=true, not both" }}
{{- else if .Values.redis.url }}
{{- $base = .Values.redis.url }}
{{- else if .Values.redis.inChart.enabled }}
{{- $base = printf "redis://%s:6379/0" (include "rollout-farm.redisName" .) }}
{{- else }}
{{- fail "redis: the service keeps its state in Redis: set redis.url (e.g. redis://redis.db:6379/0) or redis.inChart.enabled=true" }}
{{- end }}
{{- if include "rollout-farm.redisPasswordSecret" . }}
{{- $u := urlParse $base }}
{{- if $u.userinfo }}
{{- fail (printf "redis.url has credentials and redis.auth.existingSecret is set: give the password only in the Secret (the URL is visible in the RayService)") }}
{{- end }}
{{- printf "%s://:$(%s)@%s%s%s" $u.scheme (include "rollout-farm.redisPasswordVar" .) $u.host $u.path (ternary (printf "?%s" $u.query) "" (ne $u.query "")) }}
{{- else }}
{{- $base }}
{{- end }}
{{- end }}

{{/* The GCS's Redis as host:port. */}}
{{- define "rollout-farm.gcsRedisAddress" -}}
{{- if .Values.gcsFaultTolerance.redisAddress }}
{{- .Values.gcsFaultTolerance.redisAddress }}
{{- else if .Values.redis.inChart.enabled }}
{{- printf "%s:6379" (include "rollout-farm.redisName" .) }}
{{- else }}
{{- $u := urlParse .Values.redis.url }}
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

{{/* FARM_UPLOADS_DIR: uploads are written here (a safetensors folder each) before they are committed, so the
committed record is a path on the shared volume, inside FARM_WEIGHTS_DIR. */}}
{{- define "rollout-farm.uploadsDir" -}}
{{- printf "%s/uploads" (include "rollout-farm.weightsDir" .) }}
{{- end }}

{{- define "rollout-farm.cacheDir" -}}
{{- printf "%s/cache" (.Values.storage.mountPath | trimSuffix "/") }}
{{- end }}

{{/* A value as an environment variable's text: strings as they are, the rest as JSON (no 1e+06 for numbers). */}}
{{- define "rollout-farm.envText" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/* A Kubernetes quantity ("16Gi", "500M", "2", "500m") as a number of units (bytes, CPUs), or "" if unreadable. */}}
{{- define "rollout-farm.quantity" -}}
{{- if regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?$" (toString .) }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" (toString .) }}
{{- $suffix := trimPrefix $num (toString .) }}
{{- $f := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 }}
{{- mulf (float64 $num) (index $f $suffix) }}
{{- end }}
{{- end }}

{{/* An engine replica's GPUs as SGLang's tensor parallelism, checked (engine sglang only): a whole number is
FARM_SGLANG_TP_SIZE; a fraction below 1 needs settings.sglang_mem_fraction_static, below the fraction: that is the
static pool (weights and KV cache) alone, and each engine also needs memory outside it (its CUDA context,
activations, CUDA graphs), so engines sharing a GPU at exactly their share would together ask for more than the
GPU's memory. Prints the tp size, or nothing. */}}
{{- define "rollout-farm.sglangTp" -}}
{{- if and (eq .Values.engine "sglang") .Values.gpu.enabled }}
{{- $share := float64 .Values.gpu.perReplica }}
{{- $fraction := (.Values.settings | default dict).sglang_mem_fraction_static }}
{{- if ge $share 1.0 }}
{{- if ne $share (floor $share) }}
{{- fail (printf "gpu.perReplica=%v with engine sglang: an engine replica's GPUs are SGLang's tensor parallelism (FARM_SGLANG_TP_SIZE), a whole number; set gpu.perReplica to 1, 2, 4 or 8, or to a fraction below 1 with settings.sglang_mem_fraction_static" .Values.gpu.perReplica) }}
{{- end }}
{{- $share | int }}
{{- else if kindIs "invalid" $fraction }}
{{- fail (printf "gpu.perReplica=%v with engine sglang puts several engines on one GPU, and each SGLang engine takes 0.9 of its memory by default: set settings.sglang_mem_fraction_static below %v (e.g. --set-json settings.sglang_mem_fraction_static=%v), leaving room for each engine's activations" .Values.gpu.perReplica .Values.gpu.perReplica (mulf $share 0.85 | printf "%.2f")) }}
{{- else if ge (float64 $fraction) $share }}
{{- fail (printf "settings.sglang_mem_fraction_static=%v is not below gpu.perReplica=%v: it is SGLang's static pool (weights and KV cache) alone, and each engine sharing the GPU also needs memory outside it (its CUDA context, activations, CUDA graphs), so with no headroom the engines together ask for more than the GPU's memory; set it below the share, e.g. %s" $fraction .Values.gpu.perReplica (mulf $share 0.85 | printf "%.2f")) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The service's settings (FARM_*, not the secret ones) as a JSON map: the Serve application's runtime_env env_vars in
serveConfigV2, so KubeRay applies a change in place. rollout_farm/services/serving/serve_entry.py reads them in the app-build task,
which runs in that runtime_env, and the replicas inherit it.
*/}}
{{- define "rollout-farm.serveEnv" -}}
{{- $env := dict
  "FARM_APP_NAME" .Values.appName
  "FARM_MODEL" .Values.model
  "FARM_ENGINE" .Values.engine
  "FARM_DEVICE" (ternary .Values.gpu.device "cpu" .Values.gpu.enabled)
  "FARM_LOG_LEVEL" .Values.logLevel
  "FARM_REPLICAS" (.Values.replicas | int | toString)
  "FARM_MAX_REPLICAS" (ternary (.Values.autoscaling.maxReplicas | int) 0 .Values.autoscaling.enabled | toString)
  "FARM_INGRESS_REPLICAS" (.Values.ingressReplicas | int | toString)
  "FARM_FRONT" .Values.serve.front
  "FARM_HTTP_PROXY" .Values.serve.httpProxy
  "FARM_ENV_ALLOWED_HOSTS" (.Values.environments.allowedHosts | toJson)
  "FARM_MCP_SERVERS" (.Values.environments.mcpServers | toJson)
  "FARM_WEIGHTS_DIR" (include "rollout-farm.weightsDir" .)
  "FARM_UPLOADS_DIR" (include "rollout-farm.uploadsDir" .)
  "FARM_CACHE" (include "rollout-farm.cacheDir" .)
  "FARM_REQUIRE_TOKEN_FOR_GENERATION" (ternary "true" "false" .Values.token.requireForGeneration)
  "FARM_CONTROL_RESOURCE" "farm_head"
}}
{{- if .Values.gpu.enabled }}
{{- $_ := set $env "FARM_ENGINE_NUM_GPUS" (include "rollout-farm.envText" .Values.gpu.perReplica) }}
{{- end }}
{{- with include "rollout-farm.sglangTp" . }}
{{- $_ := set $env "FARM_SGLANG_TP_SIZE" . }}
{{- end }}
{{- with .Values.dtype }}
{{- $_ := set $env "FARM_DTYPE" . }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- $_ := set $env "FARM_TARGET_ONGOING_REQUESTS" (include "rollout-farm.envText" .Values.autoscaling.targetOngoingRequests) }}
{{- end }}
{{- range $key, $value := .Values.settings }}
{{- $_ := set $env (printf "FARM_%s" (upper $key)) (include "rollout-farm.envText" $value) }}
{{- end }}
{{- toJson $env }}
{{- end }}

{{/*
The Pod env of head and workers: only what is secret or read when Ray starts. The token and the Redis password come
from Secrets (the password into FARM_REDIS_URL by $(...) expansion); HAProxy is chosen when Ray starts.
*/}}
{{- define "rollout-farm.env" -}}
{{- with include "rollout-farm.redisPasswordSecret" . }}
- name: {{ include "rollout-farm.redisPasswordVar" $ }}
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.auth.key }}
{{- end }}
- name: FARM_REDIS_URL
  value: {{ include "rollout-farm.redisUrl" . | quote }}
{{ include "rollout-farm.tokenEnv" . }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" (eq .Values.serve.httpProxy "haproxy") | quote }}
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

{{/* The label of every Pod that mounts the shared volume (single-node mode keeps them together by it). */}}
{{- define "rollout-farm.volumeLabel" -}}
rollout-farm/volume: {{ .Release.Name | quote }}
{{- end }}

{{/* An init container that checks the volume is writable, and says what to fix if not: (dict "root" $ "image" ...). */}}
{{- define "rollout-farm.checkVolume" -}}
{{- if .root.Values.storage.checkWritable }}
- name: check-volume
  image: {{ .image }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os, sys, tempfile
      d = sys.argv[1]
      try:
          os.makedirs(sys.argv[2], exist_ok=True)
          with tempfile.NamedTemporaryFile(dir=d):
              pass
      except OSError as e:
          sys.exit(f"{d} is not writable by uid {os.getuid()} (gid {os.getgid()}, groups {os.getgroups()}): {e}. "
                   "Block volumes take podSecurityContext.fsGroup; NFS, EFS, Filestore and Azure Files ignore it: give "
                   "the share to uid 1000 (an EFS access point with uid/gid 1000, Azure Files mountOptions uid=1000,gid=1000, "
                   "an NFS export owned by 1000). docs/deploy.md, 'Storage'.")
      print(f"{d} is writable by uid {os.getuid()}")
    - {{ .root.Values.storage.mountPath | quote }}
    - {{ include "rollout-farm.uploadsDir" .root | quote }}
  {{- with .root.Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    requests:
      cpu: 10m
      memory: 64Mi
    limits:
      memory: 128Mi
  volumeMounts:
    {{- include "rollout-farm.volumeMounts" .root | nindent 4 }}
{{- end }}
{{- end }}

{{/*
With gpu.driverCheck: an init container of a Pod that uses GPUs, (dict "root" $ "image" ... "gpus" N), which reads
the node's NVIDIA driver with nvidia-smi (the container runtime mounts it with the Pod's GPUs: the init container
asks for the same GPUs, which the kubelet hands on to the main container) and stops the Pod, with what to do, below
gpu.driverCheck.minVersion: the GPU image is CUDA 13.0, which needs driver 580 or newer.
*/}}
{{- define "rollout-farm.checkDriver" -}}
{{- $gpu := .root.Values.gpu }}
{{- if $gpu.driverCheck.enabled }}
- name: check-driver
  image: {{ .image }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
    - python3
    - -c
    - |
      import re, shutil, subprocess, sys
      minimum = int(sys.argv[1])
      skip = "or set gpu.driverCheck.enabled=false to skip this check"
      if not shutil.which("nvidia-smi"):
          sys.exit("nvidia-smi is not in this container: the Pod does not run under NVIDIA's container runtime, so no "
                   f"GPU driver is visible. Set gpu.runtimeClassName (e.g. nvidia) where it is not the default, {skip}.")
      done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True)
      versions = done.stdout.split()
      if done.returncode or not versions:
          sys.exit(f"nvidia-smi failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()}; {skip}.")
      for version in versions:
          branch = re.match(r"\d+", version)
          if not branch or int(branch.group()) < minimum:
              sys.exit(f"NVIDIA driver {version} on this node is older than {minimum}: the GPU image is built on CUDA "
                       f"13.0, which needs driver {minimum} or newer. Upgrade the node's driver (the GPU Operator's "
                       f"driver.version), run the GPU Pods on newer nodes (gpu.nodeSelector), {skip}.")
      print(f"NVIDIA driver {versions[0]} (>= {minimum}, as CUDA 13.0 needs)")
    - {{ $gpu.driverCheck.minVersion | int | quote }}
  {{- with .root.Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    requests:
      cpu: 10m
      memory: 64Mi
      {{ $gpu.resourceName }}: {{ .gpus | int }}
    limits:
      memory: 128Mi
      {{ $gpu.resourceName }}: {{ .gpus | int }}
{{- end }}
{{- end }}

{{/*
Scheduling shared by Pods: (dict "root" $ "nodeSelector" ... "tolerations" ... "affinity" ... "spread" ...
"volume" true). priorityClassName for all; with storage.singleNode, every Pod that mounts the volume must run on the
node of the others (a required podAffinity on their common label; the first one matches itself).
*/}}
{{- define "rollout-farm.podScheduling" -}}
{{- $root := .root }}
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := deepCopy (.affinity | default dict) }}
{{- if and .volume $root.Values.storage.singleNode }}
{{- $pod := deepCopy ($affinity.podAffinity | default dict) }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "rollout-farm.volumeLabel" $root | fromYaml)) }}
{{- $_ := set $pod "requiredDuringSchedulingIgnoredDuringExecution" (append ($pod.requiredDuringSchedulingIgnoredDuringExecution | default list) $term) }}
{{- $_ := set $affinity "podAffinity" $pod }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spread }}
topologySpreadConstraints:
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

{{/* The marker the model download Job writes into the model folder when it is complete: "<repo>@<revision>". */}}
{{- define "rollout-farm.modelMarker" -}}
{{- printf "%s/.rollout-farm-download" (.Values.model | trimSuffix "/") }}
{{- end }}

{{/* With modelDownload: the head waits for the download Job's marker before Ray starts (KubeRay deploys the app only
once the head is Ready, so the app is never built before its model is there). */}}
{{- define "rollout-farm.waitModel" -}}
- name: wait-model
  image: {{ include "rollout-farm.headImage" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import sys, time
      marker, want = sys.argv[1], sys.argv[2]
      while True:
          try:
              if open(marker).read().strip() == want:
                  print("model ready:", want); break
          except OSError:
              pass
          print(f"waiting for the model download Job to write {marker} ({want})", flush=True); time.sleep(15)
    - {{ include "rollout-farm.modelMarker" . | quote }}
    - {{ printf "%s@%s" .Values.modelDownload.repo .Values.modelDownload.revision | quote }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    requests:
      cpu: 10m
      memory: 64Mi
    limits:
      memory: 128Mi
  volumeMounts:
    {{- include "rollout-farm.volumeMounts" . | nindent 4 }}
{{- end }}
