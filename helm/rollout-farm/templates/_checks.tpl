{{/* Values the chart refuses, each with what to set instead. Included by rayservice.yaml. */}}
{{- define "rollout-farm.checks" -}}
{{- if and .Values.autoscaling.enabled (le (int .Values.autoscaling.maxReplicas) (int .Values.replicas)) }}
{{- fail (printf "autoscaling.maxReplicas (%d) must exceed replicas (%d): Serve autoscales engine replicas between them" (int .Values.autoscaling.maxReplicas) (int .Values.replicas)) }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.worker.minReplicas) (int .Values.worker.maxReplicas)) }}
{{- fail (printf "worker.minReplicas (%d) must not exceed worker.maxReplicas (%d)" (int .Values.worker.minReplicas) (int .Values.worker.maxReplicas)) }}
{{- end }}
{{- if and .Values.gpu.enabled (gt (float64 .Values.gpu.perReplica) (float64 .Values.gpu.perWorker)) }}
{{- fail (printf "gpu.perReplica (%v) must not exceed gpu.perWorker (%v): an engine replica would fit on no worker" .Values.gpu.perReplica .Values.gpu.perWorker) }}
{{- end }}
{{- if and .Values.rayAuth.enabled (semverCompare "<2.52.0" .Values.rayVersion) }}
{{- fail (printf "rayAuth.enabled: Ray's token authentication needs Ray 2.52.0 or later, and rayVersion is %s (KubeRay refuses authOptions.mode token below it and creates no cluster): set rayVersion to the image's Ray, or rayAuth.enabled=false" .Values.rayVersion) }}
{{- end }}
{{- if and (eq .Values.engine "sglang") (not .Values.gpu.enabled) }}
{{- fail "engine: sglang runs on GPUs: set gpu.enabled=true (its replicas would wait for a GPU forever)" }}
{{- end }}
{{- if and .Values.modelDownload.enabled (not (hasPrefix (printf "%s/" (.Values.storage.mountPath | trimSuffix "/")) .Values.model)) }}
{{- fail (printf "modelDownload.enabled: model (%q) must be the folder on the shared volume to download into, under storage.mountPath (e.g. %s/models/%s)" .Values.model (.Values.storage.mountPath | trimSuffix "/") (.Values.modelDownload.repo | default "org/name")) }}
{{- end }}
{{- $workerResources := include "rollout-farm.workerResources" . | fromJson }}
{{- /* Every engine replica must fit on the workers (with a 0-CPU head, nowhere else): GPUs and CPUs per worker. */}}
{{- if eq (toString .Values.head.numCpus) "0" }}
{{- $engines := ternary (int .Values.autoscaling.maxReplicas) (int .Values.replicas) .Values.autoscaling.enabled }}
{{- $workers := ternary (int .Values.worker.maxReplicas) (int .Values.worker.replicas) .Values.autoscaling.enabled }}
{{- $fit := 1000000 }}
{{- $why := "" }}
{{- if .Values.gpu.enabled }}
{{- $fit = floor (addf (divf (int .Values.gpu.perWorker) (float64 .Values.gpu.perReplica)) 0.000001) | int }}
{{- $why = printf "%d GPU(s) per worker at gpu.perReplica=%v" (int .Values.gpu.perWorker) .Values.gpu.perReplica }}
{{- end }}
{{- $cpus := include "rollout-farm.quantity" (dig "limits" "cpu" (dig "requests" "cpu" "" $workerResources) $workerResources) }}
{{- $perEngine := float64 ((.Values.settings | default dict).engine_num_cpus | default 1) }}
{{- if and $cpus (gt $perEngine 0.0) }}
{{- $byCpu := floor (addf (divf (float64 $cpus) $perEngine) 0.000001) | int }}
{{- if lt $byCpu $fit }}
{{- $fit = $byCpu }}
{{- $why = printf "%v CPU(s) per worker at settings.engine_num_cpus=%v" $cpus $perEngine }}
{{- end }}
{{- end }}
{{- if lt (mul $workers $fit) $engines }}
{{- fail (printf "%d engine replicas (%s) do not fit on %d worker Pod(s) (%s): %d fit; raise %s or the per-worker resources" $engines (ternary "autoscaling.maxReplicas" "replicas" .Values.autoscaling.enabled) $workers $why (mul $workers $fit) (ternary "worker.maxReplicas" "worker.replicas" .Values.autoscaling.enabled)) }}
{{- end }}
{{- end }}
{{- /* Head sizing: an upload passes through the head, so its memory limit must exceed the largest one plus room. */}}
{{- with dig "limits" "memory" "" (deepCopy (.Values.head.resources | default dict)) }}
{{- $limit := include "rollout-farm.quantity" . }}
{{- $upload := float64 ((($.Values.settings | default dict).max_weights_bytes) | default 8589934592) }}
{{- $need := addf $upload (mulf (float64 $.Values.head.memoryHeadroomGi) 1073741824.0) }}
{{- if and $limit (le (float64 $limit) $need) }}
{{- fail (printf "head.resources.limits.memory (%v) must exceed settings.max_weights_bytes (%.1f GiB, the largest weight upload, which passes through the head) plus head.memoryHeadroomGi (%v GiB): set it above %.0fGi, or lower settings.max_weights_bytes and push larger weights by path" . (divf $upload 1073741824.0) $.Values.head.memoryHeadroomGi (ceil (divf $need 1073741824.0))) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A worker container's resources as JSON: worker.resources as given, or GPU-aware defaults (per GPU) or the CPU
defaults; then the GPUs (gpu.perWorker). */}}
{{- define "rollout-farm.workerResources" -}}
{{- $workerResources := deepCopy (.Values.worker.resources | default dict) }}
{{- if not $workerResources }}
{{- $cpu := toString .Values.worker.cpus }}
{{- $memory := toString .Values.worker.memory }}
{{- if .Values.gpu.enabled }}
{{- $cpu = toString (mul (int .Values.gpu.perWorker) (int .Values.gpu.cpusPerGpu)) }}
{{- $memory = printf "%dGi" (mul (int .Values.gpu.perWorker) (int .Values.gpu.memoryGiPerGpu)) }}
{{- end }}
{{- $workerResources = dict "requests" (dict "cpu" $cpu "memory" $memory) "limits" (dict "cpu" $cpu "memory" $memory) }}
{{- end }}
{{- if .Values.gpu.enabled }}
{{- $gpus := dict .Values.gpu.resourceName (int .Values.gpu.perWorker) }}
{{- $_ := set $workerResources "requests" (merge (deepCopy ($workerResources.requests | default dict)) $gpus) }}
{{- $_ := set $workerResources "limits" (merge (deepCopy ($workerResources.limits | default dict)) $gpus) }}
{{- end }}
{{- toJson $workerResources }}
{{- end }}
