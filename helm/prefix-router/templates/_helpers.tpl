{{/*
Names, labels and the values every component must agree on. The block-hash
settings (block size, hash algorithm, seed, LoRA adapters) are computed here
once and used by the engine, worker and router templates, so they cannot drift.
*/}}

{{- define "prefix-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefix-router.fullname" -}}
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

{{- define "prefix-router.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefix-router.labels" -}}
helm.sh/chart: {{ include "prefix-router.chart" . }}
{{ include "prefix-router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: prefix-router
{{- end }}

{{- define "prefix-router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefix-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Component labels: call with (dict "root" $ "component" "router"). */}}
{{- define "prefix-router.componentLabels" -}}
{{ include "prefix-router.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "prefix-router.componentSelectorLabels" -}}
{{ include "prefix-router.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "prefix-router.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "prefix-router.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "prefix-router.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "prefix-router.routerName" -}}
{{- printf "%s-router" (include "prefix-router.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefix-router.redisName" -}}
{{- printf "%s-redis" (include "prefix-router.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefix-router.fleetName" -}}
{{- printf "%s-fleet" (include "prefix-router.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* ---------------------------------------------------------------------------
The shared model settings, validated once. Every template that needs one of
them goes through these helpers; "prefix-router.validate" runs in each of them,
so a bad value fails the render with one clear message whichever template Helm
renders first (also under --skip-schema-validation).
--------------------------------------------------------------------------- */}}

{{- define "prefix-router.hashAlgos" -}}
sha256 sha256_cbor xxhash xxhash_cbor
{{- end }}

{{/* PYTHONHASHSEED as a string; empty when unset. Numbers from --set arrive as
float64, so format them as integers. */}}
{{- define "prefix-router.hashSeed" -}}
{{- $seed := .Values.model.hashSeed }}
{{- if kindIs "invalid" $seed }}
{{- else if kindIs "string" $seed }}
{{- $seed }}
{{- else if or (kindIs "float64" $seed) (kindIs "int" $seed) (kindIs "int64" $seed) }}
{{- $seed | int64 | toString }}
{{- else }}
{{- fail (printf "model.hashSeed must be a decimal integer string such as \"0\", got %v" $seed) }}
{{- end }}
{{- end }}

{{- define "prefix-router.validate" -}}
{{- $m := .Values.model }}
{{- $bs := $m.blockSize }}
{{- if not (or (kindIs "float64" $bs) (kindIs "int" $bs) (kindIs "int64" $bs)) }}
{{- fail (printf "model.blockSize must be an integer number of tokens >= 1, got %v" $bs) }}
{{- end }}
{{- if or (lt (float64 $bs) 1.0) (ne (float64 $bs) (float64 (int64 $bs))) }}
{{- fail (printf "model.blockSize must be an integer number of tokens >= 1, got %v" $bs) }}
{{- end }}
{{- $algos := splitList " " (include "prefix-router.hashAlgos" .) }}
{{- if not (has (toString $m.hashAlgo) $algos) }}
{{- fail (printf "model.hashAlgo must be one of %s (vLLM --prefix-caching-hash-algo), got %q" (join ", " $algos) (toString $m.hashAlgo)) }}
{{- end }}
{{- $seed := include "prefix-router.hashSeed" . }}
{{- if and (hasPrefix "xxhash" $m.hashAlgo) (eq $seed "") }}
{{- fail (printf "model.hashSeed is required when model.hashAlgo is %s: without PYTHONHASHSEED vLLM seeds xxhash block hashes with a random value per process, so the router could never match them. Set model.hashSeed to a decimal integer string, e.g. \"0\"." $m.hashAlgo) }}
{{- end }}
{{- if and (ne $seed "") (not (regexMatch "^[0-9]+$" $seed)) }}
{{- fail (printf "model.hashSeed must be a decimal integer in [0, 4294967295] (Python refuses any other PYTHONHASHSEED), got %q" $seed) }}
{{- end }}
{{- if and (ne $seed "") (gt (len $seed) 10) }}
{{- fail (printf "model.hashSeed must be a decimal integer in [0, 4294967295] (Python refuses any other PYTHONHASHSEED), got %q" $seed) }}
{{- end }}
{{- if and (ne $seed "") (gt (float64 $seed) 4294967295.0) }}
{{- fail (printf "model.hashSeed must be a decimal integer in [0, 4294967295] (Python refuses any other PYTHONHASHSEED), got %q" $seed) }}
{{- end }}
{{- range $m.loraAdapters }}
{{- if or (not .name) (not .path) }}
{{- fail "every model.loraAdapters entry needs a name and a path" }}
{{- end }}
{{- end }}
{{- include "prefix-router.validateFleetPorts" . }}
{{- if not (has .Values.fleet.engine (list "vllm" "emulator")) }}
{{- fail (printf "fleet.engine must be vllm or emulator, got %q" (toString .Values.fleet.engine)) }}
{{- end }}
{{- $stride := .Values.redis.indexStride }}
{{- if or (not (or (kindIs "float64" $stride) (kindIs "int" $stride) (kindIs "int64" $stride))) (lt (float64 $stride) 1.0) (ne (float64 $stride) (float64 (int64 $stride))) }}
{{- fail (printf "redis.indexStride must be an integer number of blocks >= 1 (1 = exact index), got %v" $stride) }}
{{- end }}
{{- $ext := .Values.redis.external }}
{{- with $ext.url }}
{{- if not (regexMatch "^rediss?(\\+cluster|\\+sentinel)?://" .) }}
{{- fail (printf "redis.external.url must start with redis://, rediss:// (TLS), redis[s]+cluster:// or redis[s]+sentinel://, got %q" .) }}
{{- end }}
{{- end }}
{{- $forms := 0 }}
{{- if $ext.url }}{{ $forms = add1 $forms }}{{ end }}
{{- if $ext.cluster.nodes }}{{ $forms = add1 $forms }}{{ end }}
{{- if $ext.sentinel.nodes }}{{ $forms = add1 $forms }}{{ end }}
{{- if gt $forms 1 }}
{{- fail "set one of redis.external.url, redis.external.cluster.nodes and redis.external.sentinel.nodes" }}
{{- end }}
{{- if and $ext.sentinel.nodes (not $ext.sentinel.masterName) }}
{{- fail "redis.external.sentinel.nodes needs redis.external.sentinel.masterName (the Sentinel master's name)" }}
{{- end }}
{{- end }}

{{- define "prefix-router.blockSize" -}}
{{- include "prefix-router.validate" . }}
{{- .Values.model.blockSize | int64 }}
{{- end }}

{{- define "prefix-router.indexStride" -}}
{{- include "prefix-router.validate" . }}
{{- .Values.redis.indexStride | int64 }}
{{- end }}

{{- define "prefix-router.hashAlgo" -}}
{{- include "prefix-router.validate" . }}
{{- .Values.model.hashAlgo }}
{{- end }}

{{- define "prefix-router.servedModelName" -}}
{{- default .Values.model.name .Values.model.servedModelName }}
{{- end }}

{{/* The tokenizer the router (and the emulator) use: model.tokenizer, else the
model itself for vLLM, else the Qwen3 files the image ships for the emulator
(its default tokenizer). */}}
{{- define "prefix-router.tokenizer" -}}
{{- if .Values.model.tokenizer }}
{{- .Values.model.tokenizer }}
{{- else if eq .Values.fleet.engine "vllm" }}
{{- .Values.model.name }}
{{- else }}
{{- print "/opt/prefix-router/tokenizers/qwen3" }}
{{- end }}
{{- end }}

{{/* LoRA adapters as vLLM's "name=path" strings, one per line. */}}
{{- define "prefix-router.loraModules" -}}
{{- range .Values.model.loraAdapters }}
{{ printf "%s=%s" .name .path }}
{{- end }}
{{- end }}

{{/* vLLM --kv-events-config JSON: pod-local ZMQ publisher and replay sockets (rank 0's;
rank r of a data-parallel engine binds each port + r). Nothing outside the pod reaches them:
the replay ROUTER binds loopback (vLLM always binds it); the PUB socket binds an ipc socket in
the pod's kv-events volume, since vLLM binds a PUB endpoint only when it is ipc/inproc or has
"*" or "::" (a tcp://127.0.0.1 endpoint it would connect). With data parallelism vLLM 0.33
offsets only tcp and inproc endpoints per rank (offset_endpoint_port raises for ipc), so
there the PUB binds tcp://*:port (the NetworkPolicy admits no peer to it). */}}
{{- define "prefix-router.kvEventsConfig" -}}
{{- $kv := .Values.fleet.kvEvents }}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (include "prefix-router.kvEventsBind" .) "replay_endpoint" (printf "tcp://127.0.0.1:%s" (include "prefix-router.kvReplayPort" .)) "buffer_steps" (int $kv.bufferSteps) "topic" "" | toJson }}
{{- end }}

{{/* The engine's KV events PUB endpoint (rank 0's) as it binds it, and as the worker
connects to it. */}}
{{- define "prefix-router.kvEventsBind" -}}
{{- if gt (int .Values.fleet.dataParallelSize) 1 }}
{{- printf "tcp://*:%d" (int .Values.fleet.kvEvents.port) }}
{{- else }}
{{- include "prefix-router.kvEventsIpc" . }}
{{- end }}
{{- end }}
{{- define "prefix-router.kvEventsConnect" -}}
{{- if gt (int .Values.fleet.dataParallelSize) 1 }}
{{- printf "tcp://127.0.0.1:%d" (int .Values.fleet.kvEvents.port) }}
{{- else }}
{{- include "prefix-router.kvEventsIpc" . }}
{{- end }}
{{- end }}
{{- define "prefix-router.kvEventsIpc" -}}ipc:///run/kv-events/publisher{{- end }}

{{/* ---------------------------------------------------------------------------
Data-parallel engines (fleet.dataParallelSize N, vLLM --data-parallel-size): one HTTP
server fronting N engine ranks in the pod. Rank r binds the KV events port + r and the
replay port + r (vLLM 0.33 offset_endpoint_port, vllm/distributed/kv_events.py); the
worker sidecar runs one worker per rank and serves rank r's metrics on metricsPort + r
(worker.report.rank_configs).
--------------------------------------------------------------------------- */}}

{{/* Rank 0's replay port: fleet.kvEvents.replayPort, or when empty the port after the
ranks' event ports (kvEvents.port + N: 5558 with one rank, as before), so that the
two ranges cannot overlap. */}}
{{- define "prefix-router.kvReplayPort" -}}
{{- $kv := .Values.fleet.kvEvents }}
{{- if kindIs "invalid" $kv.replayPort }}
{{- add (int $kv.port) (int .Values.fleet.dataParallelSize) }}
{{- else }}
{{- int $kv.replayPort }}
{{- end }}
{{- end }}

{{/* The name of rank r's worker metrics port (a container port name has at most 15
characters): worker-metrics for rank 0, worker-dp<r> for the others. Call with the rank. */}}
{{- define "prefix-router.workerMetricsPortName" -}}
{{- if eq (int .) 0 }}worker-metrics{{ else }}{{ printf "worker-dp%d" (int .) }}{{ end }}
{{- end }}

{{/* Fails the render unless every port of a fleet pod is distinct and at most 65535:
the engine's HTTP port and, per rank, its KV events, replay and worker metrics ports
(the containers share the pod's network namespace). */}}
{{- define "prefix-router.validateFleetPorts" -}}
{{- $f := .Values.fleet }}
{{- $n := $f.dataParallelSize }}
{{- if or (not (or (kindIs "float64" $n) (kindIs "int" $n) (kindIs "int64" $n))) (lt (float64 $n) 1.0) (ne (float64 $n) (float64 (int64 $n))) }}
{{- fail (printf "fleet.dataParallelSize must be an integer number of engine ranks >= 1, got %v" $n) }}
{{- end }}
{{- $n = int $n }}
{{- $replay := int (include "prefix-router.kvReplayPort" .) }}
{{- $ranges := list
  (list "the engine's HTTP port (fleet.port)" (int $f.port) 1)
  (list "KV events port (fleet.kvEvents.port" (int $f.kvEvents.port) $n)
  (list "KV replay port (fleet.kvEvents.replayPort" $replay $n)
  (list "worker metrics port (fleet.worker.metricsPort" (int $f.worker.metricsPort) $n) }}
{{- $seen := dict }}
{{- range $ranges }}
{{- $what := index . 0 }}
{{- $base := index . 1 }}
{{- range $r := until (index . 2) }}
{{- $port := add $base $r }}
{{- $owner := ternary $what (printf "rank %d's %s + %d)" $r $what $r) (hasPrefix "the engine" $what) }}
{{- if gt $port 65535 }}
{{- fail (printf "fleet.dataParallelSize=%d puts %s at %d, beyond 65535: lower the base port" $n $owner $port) }}
{{- end }}
{{- with get $seen (toString $port) }}
{{- fail (printf "fleet ports collide with fleet.dataParallelSize=%d: port %d is both %s and %s. Rank r binds fleet.kvEvents.port + r and fleet.kvEvents.replayPort + r, and the worker serves rank r's metrics on fleet.worker.metricsPort + r: give every range its own %d ports (leave fleet.kvEvents.replayPort empty to place it at fleet.kvEvents.port + dataParallelSize)" $n $port . $owner $n) }}
{{- end }}
{{- $_ := set $seen (toString $port) $owner }}
{{- end }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------------------
Redis: the URL every client uses, and the password/TLS wiring.
--------------------------------------------------------------------------- */}}

{{/* The external Redis URL from redis.external: url as given, or rendered from the Cluster
seeds (redis[s]+cluster://a:p,b:p) or the Sentinel set (redis[s]+sentinel://s1:p,s2:p/MASTER/DB);
empty for the bundled Redis. */}}
{{- define "prefix-router.redisExternalUrl" -}}
{{- $ext := .Values.redis.external }}
{{- $s := ternary "s" "" (and (kindIs "bool" $ext.tls.enabled) $ext.tls.enabled) }}
{{- if $ext.url }}
{{- $ext.url }}
{{- else if $ext.cluster.nodes }}
{{- printf "redis%s+cluster://%s" $s (join "," $ext.cluster.nodes) }}
{{- else if $ext.sentinel.nodes }}
{{- printf "redis%s+sentinel://%s/%s/%d" $s (join "," $ext.sentinel.nodes) $ext.sentinel.masterName (int $ext.sentinel.db) }}
{{- end }}
{{- end }}

{{- define "prefix-router.redisBundled" -}}
{{- if not (include "prefix-router.redisExternalUrl" .) }}true{{ end }}
{{- end }}

{{/* "true" when the external Redis is reached over TLS (rediss... URL). */}}
{{- define "prefix-router.redisTls" -}}
{{- if hasPrefix "rediss" (include "prefix-router.redisExternalUrl" .) }}true{{ end }}
{{- end }}

{{- define "prefix-router.redisTlsCaPath" -}}
/etc/prefix-router/redis-tls/{{ .Values.redis.external.tls.caKey }}
{{- end }}

{{- define "prefix-router.redisUrl" -}}
{{- include "prefix-router.validate" . }}
{{- $url := include "prefix-router.redisExternalUrl" . }}
{{- if $url }}
{{- if and (include "prefix-router.redisTls" .) .Values.redis.external.tls.caSecret }}
{{- printf "%s%sssl_ca_certs=%s" $url (ternary "&" "?" (contains "?" $url)) (include "prefix-router.redisTlsCaPath" .) }}
{{- else }}
{{- $url }}
{{- end }}
{{- else }}
{{- printf "redis://%s.%s.svc:%d/0" (include "prefix-router.redisName" .) .Release.Namespace (int .Values.redis.bundled.port) }}
{{- end }}
{{- end }}

{{/* The Redis password reaches every process as a file from the Secret (a mounted volume),
never on a command line: the router's redis_password_file, the worker's
WORKER_REDIS_PASSWORD_FILE, the bundled Redis's requirepass on its stdin. */}}
{{- define "prefix-router.redisAuthDir" -}}
/etc/prefix-router/redis-auth
{{- end }}

{{- define "prefix-router.redisPasswordFile" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{ include "prefix-router.redisAuthDir" . }}/redis-password
{{- end }}
{{- end }}

{{- define "prefix-router.redisAuthVolumeMount" -}}
{{- if .Values.redis.auth.existingSecret -}}
- name: redis-auth
  mountPath: {{ include "prefix-router.redisAuthDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "prefix-router.redisAuthVolume" -}}
{{- if .Values.redis.auth.existingSecret -}}
- name: redis-auth
  secret:
    secretName: {{ .Values.redis.auth.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.redis.auth.existingSecretPasswordKey }}
        path: redis-password
{{- end }}
{{- end }}

{{- define "prefix-router.redisTlsVolumeMount" -}}
{{- if and (include "prefix-router.redisTls" .) .Values.redis.external.tls.caSecret -}}
- name: redis-tls
  mountPath: /etc/prefix-router/redis-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "prefix-router.redisTlsVolume" -}}
{{- if and (include "prefix-router.redisTls" .) .Values.redis.external.tls.caSecret -}}
- name: redis-tls
  secret:
    secretName: {{ .Values.redis.external.tls.caSecret }}
    items:
      - key: {{ .Values.redis.external.tls.caKey }}
        path: {{ .Values.redis.external.tls.caKey }}
{{- end }}
{{- end }}

{{- define "prefix-router.hfTokenEnv" -}}
{{- if .Values.model.hfToken.existingSecret -}}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hfToken.existingSecret }}
      key: {{ .Values.model.hfToken.key }}
{{- end }}
{{- end }}

{{/* topologySpreadConstraints of a component; a constraint without a labelSelector gets the
component's own pod labels. Call with (dict "root" $ "component" "router" "constraints" LIST). */}}
{{- define "prefix-router.topologySpread" -}}
{{- $selector := dict "matchLabels" (include "prefix-router.componentSelectorLabels" (dict "root" .root "component" .component) | fromYaml) }}
{{- range .constraints }}
{{- if hasKey . "labelSelector" }}
- {{- toYaml . | nindent 2 }}
{{- else }}
- {{- toYaml (set (deepCopy .) "labelSelector" $selector) | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{- /*
Tenant isolation (router.auth): the Secrets are mounted read-only as volumes and
the router is given only their paths in router.yaml, never their contents on a
command line or in the environment. Whole-directory mounts (no subPath) so that
Secret updates reach the pod and the router reloads the keys (every 5 s).
*/ -}}
{{- define "prefix-router.authKeysDir" -}}/etc/prefix-router/api-keys{{- end }}
{{- define "prefix-router.authSaltDir" -}}/etc/prefix-router/cache-salt{{- end }}

{{- /* The router.yaml keys of router.auth (a dict), after checking the values. */ -}}
{{- define "prefix-router.authConfig" -}}
{{- $a := .Values.router.auth -}}
{{- if $a.enabled -}}
{{- if not $a.existingSecret -}}
{{- fail "router.auth.enabled needs router.auth.existingSecret: the Secret with the hashed API keys (`prefix-router auth add-key TENANT` prints them)" }}
{{- end -}}
{{- if not $a.saltSecret.name -}}
{{- fail "router.auth.enabled needs router.auth.saltSecret.name: the Secret with the cache_salt secret (e.g. --from-literal=cache-salt-secret=\"$(openssl rand -hex 32)\"), the same for every router" }}
{{- end -}}
{{- if and (eq $a.saltSecret.name $a.existingSecret) (not $a.keysKey) -}}
{{- fail "router.auth.saltSecret.name is router.auth.existingSecret, whose every key is read as a tenant's key file when router.auth.keysKey is empty: set keysKey or keep the salt in another Secret" }}
{{- end -}}
{{- range $k := list "api_keys" "cache_salt_secret_file" "client_cache_salt" "admin_tenants" "debug_access" "metrics_access" -}}
{{- if hasKey $.Values.router.extraConfig $k -}}
{{- fail (printf "router.extraConfig.%s conflicts with router.auth.enabled: set it through router.auth" $k) }}
{{- end -}}
{{- end -}}
{{- if and (eq $a.metricsAccess "admin") $.Values.metrics.serviceMonitor.enabled (not $.Values.metrics.serviceMonitor.bearerTokenSecret.name) -}}
{{- fail "router.auth.metricsAccess=admin with metrics.serviceMonitor.enabled needs metrics.serviceMonitor.bearerTokenSecret (name and key of a Secret holding an admin tenant's API key), or Prometheus gets 403 from the router" }}
{{- end -}}
{{- $keys := ternary (printf "%s/api-keys" (include "prefix-router.authKeysDir" .)) (include "prefix-router.authKeysDir" .) (ne $a.keysKey "") -}}
{{- dict
  "api_keys" $keys
  "cache_salt_secret_file" (printf "%s/cache-salt-secret" (include "prefix-router.authSaltDir" .))
  "client_cache_salt" $a.clientSalt
  "admin_tenants" $a.adminTenants
  "debug_access" $a.debugAccess
  "metrics_access" $a.metricsAccess
  | toYaml }}
{{- end -}}
{{- end }}

{{- define "prefix-router.authVolumeMounts" -}}
{{- if .Values.router.auth.enabled -}}
- name: api-keys
  mountPath: {{ include "prefix-router.authKeysDir" . }}
  readOnly: true
- name: cache-salt
  mountPath: {{ include "prefix-router.authSaltDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "prefix-router.authVolumes" -}}
{{- $a := .Values.router.auth -}}
{{- if $a.enabled -}}
- name: api-keys
  secret:
    secretName: {{ $a.existingSecret }}
    defaultMode: 0440
    {{- if $a.keysKey }}
    items:
      - key: {{ $a.keysKey }}
        path: api-keys
    {{- end }}
- name: cache-salt
  secret:
    secretName: {{ $a.saltSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ $a.saltSecret.key }}
        path: cache-salt-secret
{{- end }}
{{- end }}
