{{/* Names and labels. */}}
{{- define "forge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "forge.fullname" -}}
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

{{- define "forge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "forge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "forge.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "forge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "forge.serviceAccountName" -}}
{{- default (include "forge.fullname" .) .Values.serviceAccount.name }}
{{- end }}

{{/*
Ray's cluster token: a Secret the chart references, never creates (as every secret here), with
the key auth_token (the key KubeRay's authOptions.secretName reads).
*/}}
{{- define "forge.rayTokenSecret" -}}
{{- printf "%s-ray-token" (include "forge.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Ray's token authentication, for every container that runs Ray or talks to it (head, workers,
the autoscaler): RAY_AUTH_MODE=token, the token from the Secret. With it Ray refuses any call
without the token: GCS, raylets, workers, the replicas' gRPC servers (on every interface), the
dashboard. Ray 2.60 turns it on by itself only for a cluster ray.init starts (a laptop), not for
`ray start` (KubeRay).
*/}}
{{- define "forge.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "forge.rayTokenSecret" . }}
      key: auth_token
{{- end }}

{{/* An image reference: repository@digest when a digest is set, else repository:tag. */}}
{{- define "forge.image" -}}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository .tag }}
{{- end }}
{{- end }}

{{/*
The serve config (files/serve-config.yaml -> configs/gke.yaml) with this environment's overrides
applied to the application named serveConfig.appName, as YAML. Everything else is kept as is.
*/}}
{{- define "forge.serveConfig" -}}
{{- $raw := .Files.Get "files/serve-config.yaml" }}
{{- if not $raw }}
{{- fail "files/serve-config.yaml is missing or empty: it must be a symlink to configs/gke.yaml" }}
{{- end }}
{{- $config := fromYaml $raw }}
{{- if hasKey $config "Error" }}
{{- fail (printf "files/serve-config.yaml does not parse: %s" $config.Error) }}
{{- end }}
{{- $values := .Values.serveConfig }}
{{- $found := false }}
{{- $apps := list }}
{{- range $app := required "the serve config has no applications" $config.applications }}
{{- if eq $app.name $values.appName }}
{{- $found = true }}
{{- $args := mergeOverwrite (deepCopy (default dict $app.args)) (deepCopy $values.forgeArgs) }}
{{- $vertex := $values.vertex }}
{{- if or $vertex.project $vertex.region }}
{{- if not (and $vertex.project $vertex.region) }}
{{- fail "serveConfig.vertex: set both project and region (or neither)" }}
{{- end }}
{{- $fallback := required "serveConfig.vertex is set but the app has no fallback" $args.fallback }}
{{- if eq $vertex.region "global" }}
{{- $_ := set $fallback "base_url" (printf "https://aiplatform.googleapis.com/v1/projects/%s/locations/global/endpoints/openapi" $vertex.project) }}
{{- else }}
{{- $_ := set $fallback "base_url" (printf "https://%s-aiplatform.googleapis.com/v1/projects/%s/locations/%s/endpoints/openapi" $vertex.region $vertex.project $vertex.region) }}
{{- end }}
{{- end }}
{{- $runtimeEnv := mergeOverwrite (deepCopy (default dict $app.runtime_env)) (deepCopy $values.runtimeEnv) }}
{{- $app = merge (dict "args" $args "runtime_env" $runtimeEnv) (omit $app "args" "runtime_env") }}
{{- else if hasPrefix "serve_app.app:build_pool" (toString $app.import_path) }}
{{- /* A pool's own application runs Forge's code too: the same runtimeEnv (py_modules). */}}
{{- $runtimeEnv := mergeOverwrite (deepCopy (default dict $app.runtime_env)) (deepCopy $values.runtimeEnv) }}
{{- /* set, not merge: a merge drops the app's `route_prefix: null`, and Serve reads "/". */}}
{{- $_ := set $app "runtime_env" $runtimeEnv }}
{{- end }}
{{- $apps = append $apps $app }}
{{- end }}
{{- if not $found }}
{{- fail (printf "the serve config has no application named %q (serveConfig.appName)" $values.appName) }}
{{- end }}
{{- $_ := set $config "applications" $apps }}
{{- toYaml $config }}
{{- end }}

{{/*
The admin port: FORGE_ADMIN_PORT of the serve config's controller_options, where forge-haproxy
serves the operator's routes (/admin/*, fault injection, /docs, /openapi.json) while :8000
answers them 404 (serve_app/tools/haproxy_loopback.py). Required: without it the admin routes
would be on the clients' port. One source: the container ports, the admin Service and the
NetworkPolicy take it from here.
*/}}
{{- define "forge.adminPort" -}}
{{- $config := include "forge.serveConfig" . | fromYaml }}
{{- $env := dig "controller_options" "runtime_env" "env_vars" dict $config }}
{{- $port := required "the serve config sets no controller_options.runtime_env.env_vars.FORGE_ADMIN_PORT: the admin routes would be on the clients' :8000" (get $env "FORGE_ADMIN_PORT") }}
{{- if or (eq (int $port) 8000) (lt (int $port) 1) (gt (int $port) 65535) }}
{{- fail (printf "FORGE_ADMIN_PORT=%v: need a TCP port other than the clients' 8000" $port) }}
{{- end }}
{{- int $port }}
{{- end }}

{{/* The Forge application's `args`, from the rendered serve config, as YAML. */}}
{{- define "forge.appArgs" -}}
{{- $config := include "forge.serveConfig" . | fromYaml }}
{{- range $config.applications }}
{{- if eq .name $.Values.serveConfig.appName }}
{{- toYaml .args }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Environment of every Ray container. Secrets only by reference; the variable names are the ones
the serve config names (store.redis_url_env, cache.store.redis_url_env,
metering.database_url_env, fallback.api_key_env), so the two cannot drift.
Arguments: root, group (the group's values).
*/}}
{{- define "forge.env" -}}
{{- $root := .root }}
{{- $config := include "forge.serveConfig" $root | fromYaml }}
{{- $args := include "forge.appArgs" $root | fromYaml }}
{{- $drain := sub (sub (int .group.terminationGracePeriodSeconds) (int .group.preStopSleepSeconds)) (int $root.Values.drain.exitMarginSeconds) }}
{{- if lt $drain 1 }}
{{- fail "terminationGracePeriodSeconds must exceed preStopSleepSeconds + drain.exitMarginSeconds" }}
{{- end -}}
{{ include "forge.rayAuthEnv" $root }}
# Ray drains on SIGTERM: Serve moves or stops this node's replicas within this.
- name: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
  value: {{ $drain | quote }}
{{- $controllerEnv := dict }}
{{- with $config.controller_options }}{{ with .runtime_env }}{{ with .env_vars }}{{ $controllerEnv = . }}{{ end }}{{ end }}{{ end }}
{{- range $name, $value := $controllerEnv }}
# The Serve controller's env (controller_options), so all Serve processes agree.
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
# Triton's cache on the writable cache volume (read-only root file system).
- name: TRITON_CACHE_DIR
  value: /home/ray/.cache/triton
{{- with $args.store }}{{ with .redis_url_env }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.secrets.redisUrl.name }}
      key: {{ $root.Values.secrets.redisUrl.key }}
{{- end }}{{ end }}
{{- with $args.cache }}{{ with .store }}{{ with .redis_url_env }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.secrets.cacheRedisUrl.name }}
      key: {{ $root.Values.secrets.cacheRedisUrl.key }}
{{- end }}{{ end }}{{ end }}
{{- with $args.metering }}{{ with .database_url_env }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.secrets.ledgerUrl.name }}
      key: {{ $root.Values.secrets.ledgerUrl.key }}
{{- end }}{{ end }}
{{- with $args.fallback }}
{{- if or (eq (toString .auth) "api_key") (and (not .auth) .api_key_env) }}
- name: {{ required "fallback.auth is api_key but fallback.api_key_env is unset" .api_key_env }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.secrets.geminiApiKey.name }}
      key: {{ $root.Values.secrets.geminiApiKey.key }}
{{- end }}
{{- end }}
{{- with $root.Values.secrets.kvCurveSecret }}{{ if .name }}
{{- $secret := . }}
{{- $names := include "forge.kvCurveEnvs" $root }}
{{- range $name := $names | splitList "," | compact }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret.name }}
      key: {{ $secret.key }}
{{- end }}
{{- end }}{{ end }}
{{- with $root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The variables the kv_aware pools of the serve config read their KV events' CURVE secret from
(routing.kv_events.curve_secret_env, FORGE_KV_CURVE_SECRET by default; none for auth: none),
joined by commas: pools in an application of their own (args.pool) and in the gateway's
(args.pools).
*/}}
{{- define "forge.kvCurveEnvs" -}}
{{- $config := include "forge.serveConfig" . | fromYaml }}
{{- $names := dict }}
{{- range $app := $config.applications }}
{{- $args := default dict $app.args }}
{{- $pools := default list $args.pools }}
{{- with $args.pool }}{{ $pools = append $pools . }}{{ end }}
{{- range $pool := $pools }}
{{- $routing := default dict $pool.routing }}
{{- $events := default dict $routing.kv_events }}
{{- if and (eq (toString $routing.policy) "kv_aware") (ne (toString $events.auth) "none") }}
{{- $_ := set $names (default "FORGE_KV_CURVE_SECRET" $events.curve_secret_env) true }}
{{- end }}
{{- end }}
{{- end }}
{{- keys $names | sortAlpha | join "," }}
{{- end }}

{{/*
The key-hash files the serve config reads, as one projected volume of the two secrets, mounted
at the directory of key_hashes_file. Returns "" when the config reads no key files.
*/}}
{{- define "forge.keysDir" -}}
{{- $args := include "forge.appArgs" . | fromYaml }}
{{- with $args.key_hashes_file }}{{ dir . }}{{ end }}
{{- end }}

{{- define "forge.keysVolume" -}}
{{- $args := include "forge.appArgs" . | fromYaml }}
{{- $dir := include "forge.keysDir" . }}
- name: forge-keys
  projected:
    defaultMode: 0440
    sources:
      - secret:
          name: {{ .Values.secrets.tenantKeyHashes.name }}
          items:
            - key: {{ .Values.secrets.tenantKeyHashes.key }}
              path: {{ base $args.key_hashes_file }}
{{- with .Values.secrets.redisCa }}{{ if .name }}
      - secret:
          name: {{ .name }}
          items:
            - key: {{ .key }}
              path: redis-ca.pem
{{- end }}{{ end }}
{{- with $args.cache }}{{ if .store }}{{ with $.Values.secrets.cacheRedisCa }}{{ if .name }}
      - secret:
          name: {{ .name }}
          items:
            - key: {{ .key }}
              path: redis-cache-ca.pem
{{- end }}{{ end }}{{ end }}{{ end }}
{{- if .Values.gcsFaultTolerance.enabled }}{{ with .Values.secrets.rayGcsRedisCa }}
      - secret:
          name: {{ .name }}
          items:
            - key: {{ .key }}
              path: ray-gcs-redis-ca.pem
{{- end }}{{ end }}
{{- with $args.admin }}{{ with .key_hashes_file }}
{{- if ne (dir .) $dir }}
{{- fail (printf "admin.key_hashes_file (%s) must be in the directory of key_hashes_file (%s)" . $dir) }}
{{- end }}
      - secret:
          name: {{ $.Values.secrets.adminKeyHashes.name }}
          items:
            - key: {{ $.Values.secrets.adminKeyHashes.key }}
              path: {{ base . }}
{{- end }}{{ end }}
{{- end }}

{{/*
Scheduling of a group: spot groups select GKE's spot nodes (and tolerate a spot taint), the others
keep off spot and preemptible nodes; the GPU group selects its accelerator and tolerates GKE's GPU
taint. Arguments: group, gpu (bool).
*/}}
{{- define "forge.scheduling" -}}
{{- $selector := dict }}
{{- if .group.spot }}
{{- $_ := set $selector "cloud.google.com/gke-spot" "true" }}
{{- end }}
{{- if .gpu }}
{{- $_ := set $selector "cloud.google.com/gke-accelerator" .group.gkeAccelerator }}
{{- end }}
{{- $selector = merge (deepCopy .group.nodeSelector) $selector }}
{{- with $selector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if not .group.spot }}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - {key: cloud.google.com/gke-spot, operator: DoesNotExist}
            - {key: cloud.google.com/gke-preemptible, operator: DoesNotExist}
{{- end }}
{{- $tolerations := list }}
{{- if .group.spot }}
{{- $tolerations = append $tolerations (dict "key" "cloud.google.com/gke-spot" "operator" "Equal" "value" "true" "effect" "NoSchedule") }}
{{- end }}
{{- if .gpu }}
{{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
{{- $tolerations = concat $tolerations .group.tolerations }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
A Ray pod template. Arguments: root, group (values), component, container (name), image (values),
head (bool), gpu (bool), ports (list).
*/}}
{{- define "forge.rayPodTemplate" -}}
{{- $root := .root }}
{{- $values := $root.Values }}
{{- $keysDir := include "forge.keysDir" $root -}}
{{- $weights := and .gpu $values.modelWeights.bucket -}}
metadata:
  labels:
    {{- include "forge.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
  {{- if $weights }}
  annotations:
    # GKE's Cloud Storage FUSE CSI driver injects its sidecar (which mounts the bucket with the
    # pod's workload identity) only into pods that ask for it.
    gke-gcsfuse/volumes: "true"
  {{- end }}
spec:
  serviceAccountName: {{ include "forge.serviceAccountName" $root }}
  # No Kubernetes API token in Ray's containers (workload identity needs none); only the
  # autoscaler sidecar mounts one (autoscalerOptions.volumeMounts).
  automountServiceAccountToken: false
  # No {SERVICE}_PORT variables: a Service named vllm would set VLLM_PORT=tcp://...,
  # which vLLM reads as its own setting.
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ .group.terminationGracePeriodSeconds }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ $values.securityContext.runAsUser }}
    runAsGroup: {{ $values.securityContext.runAsGroup }}
    fsGroup: {{ $values.securityContext.fsGroup }}
    seccompProfile:
      type: RuntimeDefault
  {{- include "forge.scheduling" (dict "group" .group "gpu" .gpu) | trim | nindent 2 }}
  containers:
    - name: {{ .container }}
      image: {{ include "forge.image" .image }}
      imagePullPolicy: {{ .image.pullPolicy }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      env:
        {{- include "forge.env" (dict "root" $root "group" .group) | trim | nindent 8 }}
        {{- if and .head $values.gcsFaultTolerance.enabled }}
        # GCS fault tolerance: the Redis gcsFaultToleranceOptions.redisAddress names (expanded by
        # Kubernetes into KubeRay's RAY_REDIS_ADDRESS), and the CA its TLS is verified against.
        - name: FORGE_RAY_GCS_REDIS_ADDRESS
          valueFrom:
            secretKeyRef:
              name: {{ $values.secrets.rayGcsRedisAddress.name }}
              key: {{ $values.secrets.rayGcsRedisAddress.key }}
        - name: RAY_REDIS_CA_CERT
          value: {{ printf "%s/ray-gcs-redis-ca.pem" $keysDir }}
        {{- end }}
        {{- with $values.secrets.hfToken }}{{ if and $.gpu .name }}
        # Hugging Face's token (secrets.hfToken), for pools whose engine.model is a Hub id.
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ .name }}
              key: {{ .key }}
        {{- end }}{{ end }}
      resources:
        {{- $resources := deepCopy .group.resources }}
        {{- if .gpu }}
        {{- $_ := set $resources.limits "nvidia.com/gpu" (toString .group.gpus) }}
        {{- $_ := set $resources.requests "nvidia.com/gpu" (toString .group.gpus) }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        runAsNonRoot: true
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: {{ $values.securityContext.readOnlyRootFilesystem }}
        capabilities:
          drop: [ALL]
      {{- if and (not .head) (not .group.serveEndpoint) }}
      # Never Ready, so never an endpoint of the Serve Service (values: serveEndpoint): KubeRay
      # labels every worker ray.io/serve=true, and readiness is what it leaves to decide. With a
      # probe here KubeRay injects none (its raylet and proxy check); liveness stays KubeRay's.
      # What acts on readiness does not read a worker's: Ray's autoscaler goes by the Ray
      # container running, KubeRay's switch by the head and the Serve applications' status (the
      # RayCluster's status counts the pod as not ready: helm/forge/README.md).
      readinessProbe:
        exec:
          command: ["false"]
        periodSeconds: 300
        failureThreshold: 1
      {{- end }}
      # exec, not the sleep action: KubeRay's CRD prunes fields its embedded pod schema predates.
      lifecycle:
        preStop:
          exec:
            command: [sleep, {{ .group.preStopSleepSeconds | quote }}]
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        - {name: cache, mountPath: /home/ray/.cache}
        - {name: config, mountPath: /home/ray/.config}
        {{- if $keysDir }}
        - {name: forge-keys, mountPath: {{ $keysDir }}, readOnly: true}
        {{- end }}
        {{- if $weights }}
        # The weights bucket (modelWeights), where configs/gke.yaml's vLLM pools load from.
        - {name: model-weights, mountPath: {{ $values.modelWeights.mountPath }}, readOnly: true}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {sizeLimit: {{ .group.tmpSizeLimit }}}
    - name: cache
      emptyDir: {sizeLimit: {{ .group.cacheSizeLimit }}}
    - name: config
      emptyDir: {sizeLimit: 64Mi}
    {{- if $keysDir }}
    {{- include "forge.keysVolume" $root | trim | nindent 4 }}
    {{- end }}
    {{- if $weights }}
    - name: model-weights
      csi:
        driver: gcsfuse.csi.storage.gke.io
        readOnly: true
        volumeAttributes:
          bucketName: {{ $values.modelWeights.bucket }}
          mountOptions: {{ $values.modelWeights.mountOptions | quote }}
    {{- end }}
    {{- if .head }}
    # The autoscaler sidecar's API credentials (it patches the RayCluster's replicas;
    # KubeRay binds its Role to this ServiceAccount). Mounted in that container only.
    - name: autoscaler-kube-api
      projected:
        defaultMode: 0440
        sources:
          - serviceAccountToken:
              path: token
              expirationSeconds: 3607
          - configMap:
              name: kube-root-ca.crt
              items:
                - {key: ca.crt, path: ca.crt}
          - downwardAPI:
              items:
                - path: namespace
                  fieldRef: {fieldPath: metadata.namespace}
    {{- end }}
{{- end }}
