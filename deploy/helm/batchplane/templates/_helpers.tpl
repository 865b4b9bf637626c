{{/*
Names, labels, the job configuration and the pieces trainer pods include.

Templates meant for users' own pod specs (see deploy/helm/README.md):
  batchplane.podSecurityContext   the pod's securityContext: its fsGroup is the group that may enter the socket folder
  batchplane.constructorSidecar   the constructor, for the pod's initContainers (native sidecar)
  batchplane.volumes              the socket emptyDir, the job ConfigMap, a /tmp emptyDir, the sidecar's certificate and token Secrets
                                  (tls.mode issued, certManager or existingSecret: its certificate emptyDir, its projected ServiceAccount token and the CA certificate)
  batchplane.trainerServiceAccountName  the pod's serviceAccountName (tls.mode issued, certManager or existingSecret: an account the issuer gives constructor identities)
  batchplane.trainerEnv           BATCHPLANE_CONSTRUCTOR, where the sidecar publishes its index, and the index's inputs
  batchplane.trainerVolumeMounts  the socket folder, for the trainer container
  batchplane.trainerLabels        the labels the NetworkPolicy admits trainer pods by
  batchplane.trainerPodAnnotations  scrape annotations for the sidecar's metrics port
  batchplane.trainerEgressRules   NetworkPolicy egress rules the sidecar needs (planner, loaders, issuer, DNS)
Each takes this chart's context: `.` inside this chart, `.Subcharts.batchplane` in a parent chart.
*/}}

{{/* Fixed ports: the operator and the DataPlane contract rely on them. */}}
{{- define "batchplane.plannerGrpcPort" -}}50051{{- end }}
{{- define "batchplane.loaderGrpcPort" -}}50052{{- end }}
{{- define "batchplane.metricsPort" -}}9100{{- end }}
{{/* The emptyDir the trainer container and the sidecar share (the socket's folder and the index file). */}}
{{- define "batchplane.socketDir" -}}/run/batchplane{{- end }}
{{/* The trainer's socket: in a folder of its own, which the constructor makes (mode 2770, the pod's
fsGroup) before it binds; the emptyDir itself lets every user in, so the socket cannot lie there. */}}
{{- define "batchplane.socketAddress" -}}unix:///run/batchplane/socket/constructor.sock{{- end }}
{{/* Where the sidecar writes its constructor index for the trainer container (--publish-index). */}}
{{- define "batchplane.indexFile" -}}/run/batchplane/constructor-index{{- end }}
{{- define "batchplane.configDir" -}}/etc/batchplane{{- end }}
{{- define "batchplane.stateDir" -}}/var/lib/batchplane{{- end }}
{{/* Where a part reads its certificate (ca.crt, tls.crt, tls.key): --tls-dir (with the
operator as issuer, batchplane.tlsIssued, an in-memory emptyDir the part writes its issued
certificate into). */}}
{{- define "batchplane.tlsDir" -}}/etc/batchplane/tls{{- end }}
{{/* batchplane.tlsIssued: where a part reads its projected ServiceAccount token (token) and the CA
certificate (ca.crt) it verifies the issuer by; where the operator reads the CA it signs with
(ca.crt, ca.key). */}}
{{- define "batchplane.issuerDir" -}}/etc/batchplane/issuer{{- end }}
{{- define "batchplane.issuerCaDir" -}}/etc/batchplane/ca{{- end }}
{{/* Where servers mount the whole tokens Secret (--auth-tokens), and callers only their own key (--token-file). */}}
{{- define "batchplane.authTokensDir" -}}/etc/batchplane/auth-tokens{{- end }}
{{- define "batchplane.tokenDir" -}}/etc/batchplane/token{{- end }}
{{/* The HTTP path of every service's metrics port that answers 200 while its grpc.health.v1 is SERVING. */}}
{{- define "batchplane.healthPath" -}}/healthz{{- end }}

{{- define "batchplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name: the prefix of every resource and the DataPlane's name. At most 40 characters, so
that "<name>-<component>" names stay distinct and within 63.
*/}}
{{- define "batchplane.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<suffix>", e.g. (dict "root" . "suffix" "planner"). */}}
{{- define "batchplane.componentName" -}}
{{- printf "%s-%s" (include "batchplane.fullname" .root) .suffix | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchplane.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "batchplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "batchplane.labels" -}}
helm.sh/chart: {{ include "batchplane.chart" . }}
{{ include "batchplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchplane
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component: (dict "root" . "component" "planner"). */}}
{{- define "batchplane.componentLabels" -}}
{{ include "batchplane.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "batchplane.componentSelectorLabels" -}}
{{ include "batchplane.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "batchplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "batchplane.plannerHost" -}}
{{- printf "%s.%s.svc" (include "batchplane.componentName" (dict "root" . "suffix" "planner")) .Release.Namespace }}
{{- end }}

{{/* The planner's gRPC address, as loaders and constructors dial it. */}}
{{- define "batchplane.plannerAddress" -}}
{{- printf "%s:%s" (include "batchplane.plannerHost" .) (include "batchplane.plannerGrpcPort" .) }}
{{- end }}

{{- define "batchplane.jobConfigMapName" -}}
{{- include "batchplane.componentName" (dict "root" . "suffix" "job") }}
{{- end }}

{{- define "batchplane.world" -}}
{{- $m := .Values.mesh }}
{{- mul (int $m.dp) (int $m.cp) (int $m.tp) (int $m.pp) }}
{{- end }}

{{/* Trainer pods (= constructors): ceil(world / trainer.ranksPerPod). */}}
{{- define "batchplane.trainerPods" -}}
{{- $world := include "batchplane.world" . | int }}
{{- $per := int .Values.trainer.ranksPerPod }}
{{- div (add $world $per -1) $per }}
{{- end }}

{{- define "batchplane.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ int .Values.securityContext.runAsUser }}
runAsGroup: {{ int .Values.securityContext.runAsGroup }}
fsGroup: {{ int .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "batchplane.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ int .Values.securityContext.runAsUser }}
runAsGroup: {{ int .Values.securityContext.runAsGroup }}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Environment of every batchplane service container (read-only root: nothing is written
outside the mounted emptyDirs). */}}
{{- define "batchplane.serviceEnv" -}}
- name: PYTHONUNBUFFERED
  value: "1"
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: HOME
  value: /tmp
{{- end }}

{{/* Scrape annotations: (dict "root" . "port" 9100). */}}
{{- define "batchplane.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Pod annotation that restarts pods when the job configuration changes. */}}
{{- define "batchplane.configChecksum" -}}
checksum/job-config: {{ include "batchplane.jobConfigMapData" . | sha256sum }}
{{- end }}

{{/* The label every pod to scrape carries (the metrics Service selects by it). */}}
{{- define "batchplane.scrapeSelector" -}}
batchplane.dev/scrape: {{ include "batchplane.fullname" . }}
{{- end }}

{{/* Labels the NetworkPolicy admits trainer pods (and their constructor sidecars) by. */}}
{{- define "batchplane.trainerSelectorLabels" -}}
{{- if .Values.trainer.selectorLabels -}}
{{- toYaml .Values.trainer.selectorLabels }}
{{- else -}}
batchplane.dev/trainer: {{ include "batchplane.fullname" . }}
{{- end }}
{{- end }}

{{/* Labels of a trainer pod: admitted by the NetworkPolicy, scraped through the metrics Service. */}}
{{- define "batchplane.trainerLabels" -}}
{{ include "batchplane.trainerSelectorLabels" . }}
{{ include "batchplane.scrapeSelector" . }}
{{- end }}

{{/* Labels the operator must put on every loader pod (DataPlane spec.loader.podLabels). */}}
{{- define "batchplane.loaderPodLabels" -}}
{{ include "batchplane.selectorLabels" . }}
app.kubernetes.io/component: loader
app.kubernetes.io/part-of: batchplane
batchplane.dev/dataplane: {{ include "batchplane.fullname" . }}
{{ include "batchplane.scrapeSelector" . }}
{{- end }}

{{/* ---- the job configuration ------------------------------------------------------------ */}}

{{/*
Fails with a message naming the value when values are inconsistent in ways the schema cannot
say (cross-field rules).
*/}}
{{- define "batchplane.validate" -}}
{{- $v := .Values }}
{{- $groups := dict }}
{{- $sources := dict }}
{{- range $i, $g := $v.sourceGroups }}
{{- if hasKey $groups $g.name }}
{{- fail (printf "sourceGroups[%d].name: %q is used by another group" $i $g.name) }}
{{- end }}
{{- $_ := set $groups $g.name true }}
{{- $min := int (ternary $g.minReplicas $v.loader.minReplicas (hasKey $g "minReplicas")) }}
{{- $max := int (ternary $g.maxReplicas $v.loader.maxReplicas (hasKey $g "maxReplicas")) }}
{{- if lt $max $min }}
{{- fail (printf "sourceGroups[%d].maxReplicas: must be >= minReplicas (%d), got %d" $i $min $max) }}
{{- end }}
{{- range $j, $s := $g.sources }}
{{- if hasKey $sources $s.name }}
{{- fail (printf "sourceGroups[%d].sources[%d].name: source %q is listed twice" $i $j $s.name) }}
{{- end }}
{{- $_ := set $sources $s.name true }}
{{- end }}
{{- end }}
{{- range $name, $w := (default dict $v.mixture.weights) }}
{{- if not (hasKey $sources $name) }}
{{- fail (printf "mixture.weights.%s: names no source; sources are %s" $name (keys $sources | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- $perStep := mul (int $v.mesh.dp) (int $v.batch.microbatches) }}
{{- if lt (int $v.batch.globalBatchSize) $perStep }}
{{- fail (printf "batch.globalBatchSize: must be >= mesh.dp * batch.microbatches = %d, got %d" $perStep (int $v.batch.globalBatchSize)) }}
{{- end }}
{{- if and $v.strategy (not (hasKey (default dict $v.strategyFiles) $v.strategy)) }}
{{- fail (printf "strategy: %q is not a key of strategyFiles" $v.strategy) }}
{{- end }}
{{- $settings := default dict $v.job.settings }}
{{- range $key := list "job" "seed" "epochs" "sources" "mixture" "mesh" "strategy" "run_dir" }}
{{- if hasKey $settings $key }}
{{- fail (printf "job.settings.%s: set by the chart; use the chart's own value instead" $key) }}
{{- end }}
{{- end }}
{{- range $pair := list (list "network" "host") (list "network" "tls") (list "network" "insecure") (list "batch" "global_batch_size") (list "batch" "microbatches") (list "constructors" "ranks_per_constructor") }}
{{- $section := get $settings (index $pair 0) }}
{{- if and (kindIs "map" $section) (hasKey $section (index $pair 1)) }}
{{- fail (printf "job.settings.%s.%s: set by the chart; use the chart's own value instead" (index $pair 0) (index $pair 1)) }}
{{- end }}
{{- end }}
{{- $ledger := default dict (get $settings "ledger") }}
{{- if and (kindIs "map" $ledger) (hasKey $ledger "location") }}
{{- fail "job.settings.ledger.location: set by the chart; use planner.ledger.location instead" }}
{{- end }}
{{- if $v.example.enabled }}
{{- $kind := default "job" $v.example.kind }}
{{- if and (eq $kind "job") (gt (include "batchplane.trainerPods" . | int) 1) }}
{{- fail (printf "example.enabled: tiny_lm meets its peers on 127.0.0.1, so all %s ranks must share one pod; set trainer.ranksPerPod to %s, or example.kind to a multi-pod example (torchrun, pytorchjob, jobset, leaderworkerset)" (include "batchplane.world" .) (include "batchplane.world" .)) }}
{{- end }}
{{- $source := get (include "batchplane.exampleIndexSources" . | fromYaml) $kind }}
{{- if ne $source $v.constructor.indexFrom }}
{{- fail (printf "constructor.indexFrom: example.kind %s gives each pod its index through %q; set constructor.indexFrom to %q, got %q" $kind $source $source $v.constructor.indexFrom) }}
{{- end }}
{{- if and (eq $kind "jobset") (mod (include "batchplane.trainerPods" . | int) (int $v.example.jobsetJobs)) }}
{{- fail (printf "example.jobsetJobs: must divide the %s trainer pods, got %d" (include "batchplane.trainerPods" .) (int $v.example.jobsetJobs)) }}
{{- end }}
{{- end }}
{{- range $component := list "planner" "loader" "constructor" }}
{{- if get $v.tls.existingSecret $component }}
{{- fail (printf "tls.existingSecret.%s: per-part Secrets are no longer taken (one certificate per part lets any pod of a part act for every replica of it). Remove it and use tls.existingSecret.ca: your CA's Secret, with which the operator issues each pod a certificate of its own" $component) }}
{{- end }}
{{- end }}
{{- if and (eq $v.tls.mode "existingSecret") (not $v.tls.existingSecret.ca) }}
{{- fail "tls.existingSecret.ca: empty: tls.mode existingSecret needs your CA's Secret (type kubernetes.io/tls: tls.crt the CA certificate the operator signs with, a root or an intermediate followed by the chain above it; tls.key its ECDSA P-256 key; ca.crt the root every part trusts)" }}
{{- end }}
{{- if eq (include "batchplane.tlsIssued" .) "true" }}
{{- include "batchplane.validateIssued" . }}
{{- end }}
{{- include "batchplane.validatePodFields" (dict "at" "loader" "fields" $v.loader "reserveVolumes" true) }}
{{- include "batchplane.validatePodFields" (dict "at" "planner" "fields" $v.planner "reserveVolumes" false) }}
{{- end }}

{{/*
batchplane.tlsIssued (tls.mode issued, certManager or existingSecret): this release's operator
pods issue the certificates (with operator.enabled false they serve the issuer alone); it reads a constructor's index from its trainer pod, which an env:NAME source is
not; no bearer tokens; a token audience the API server does not accept (a token for the issuer
must not be one for the API server); and each ServiceAccount names one role (the issuer gives a
pod the role of its account).
*/}}
{{- define "batchplane.validateIssued" -}}
{{- $v := .Values }}
{{- $mode := $v.tls.mode }}
{{- if hasPrefix "env:" $v.constructor.indexFrom }}
{{- fail (printf "constructor.indexFrom: tls.mode %s reads each trainer pod's constructor index from the pod itself (its labels, annotations or name), which %q is not; choose indexed-job, pod-ordinal, kubeflow, jobset or leaderworkerset, or another tls.mode" $mode $v.constructor.indexFrom) }}
{{- end }}
{{- if $v.auth.tokens.enabled }}
{{- fail (printf "auth.tokens.enabled: tls.mode %s names each pod's own identity in its certificate; bearer tokens, shared by every pod of a role, would undo that. Set auth.tokens.enabled: false, or choose another tls.mode" $mode) }}
{{- end }}
{{- $apiAudiences := list "https://kubernetes.default.svc" (printf "https://kubernetes.default.svc.%s" $v.tls.clusterDomain) "kubernetes" "api" }}
{{- if not $v.tls.issued.audience }}
{{- fail "tls.issued.audience: empty: a projected token without an audience is one for the Kubernetes API server, and every pod hands its token to the issuer. Choose an audience of batchplane's own, e.g. batchplane" }}
{{- else if has $v.tls.issued.audience $apiAudiences }}
{{- fail (printf "tls.issued.audience: %q is the Kubernetes API server's own audience: every pod hands its token to the issuer, and a token for that audience would be usable against the API server. Choose an audience of batchplane's own, e.g. batchplane (refused: %s)" $v.tls.issued.audience (join ", " $apiAudiences)) }}
{{- end }}
{{- $accounts := dict }}
{{- $named := list (list "planner.serviceAccountName" "planner" (include "batchplane.plannerServiceAccountName" .)) (list "loader.serviceAccountName" "loader" (include "batchplane.loaderServiceAccountName" .)) (list "the trainer pods' account" "constructor" (include "batchplane.trainerServiceAccountName" .)) }}
{{- range $i, $account := $v.tls.issued.constructorServiceAccounts }}
{{- $named = append $named (list (printf "tls.issued.constructorServiceAccounts[%d]" $i) "constructor" $account) }}
{{- end }}
{{- range $entry := $named }}
{{- $account := index $entry 2 }}
{{- if hasKey $accounts $account }}
{{- fail (printf "%s: ServiceAccount %q is already named by %s; with tls.mode %s the issuer gives a pod the role of its ServiceAccount, so each role needs accounts of its own" (index $entry 0) $account (get $accounts $account) $v.tls.mode) }}
{{- end }}
{{- $_ := set $accounts $account (index $entry 0) }}
{{- end }}
{{- end }}

{{/*
The index source each example kind's pods need (constructor.indexFrom).
*/}}
{{- define "batchplane.exampleIndexSources" -}}
job: indexed-job
torchrun: indexed-job
pytorchjob: kubeflow
jobset: jobset
leaderworkerset: leaderworkerset
{{- end }}

{{/*
What batchplane reserves in the pods it renders or has the operator render (the same rules as
batchplane.operator.podfields, which the operator applies to spec.loader): (dict "at" "loader"
"fields" .Values.loader "reserveVolumes" true).
*/}}
{{- define "batchplane.validatePodFields" -}}
{{- $reservedEnv := list "POD_IP" "POD_NAME" "PYTHONUNBUFFERED" "PYTHONDONTWRITEBYTECODE" "HOME" }}
{{- $seen := dict }}
{{- range $i, $e := (default list .fields.env) }}
{{- if has $e.name $reservedEnv }}
{{- fail (printf "%s.env[%d].name: %q is set by batchplane (%s are reserved)" $.at $i $e.name (join ", " $reservedEnv)) }}
{{- end }}
{{- if hasKey $seen $e.name }}
{{- fail (printf "%s.env[%d].name: %q is listed twice" $.at $i $e.name) }}
{{- end }}
{{- $_ := set $seen $e.name true }}
{{- end }}
{{- if .reserveVolumes }}
{{- $reservedVolumes := list "batchplane-job" "tmp" "batchplane-tls" "batchplane-auth-tokens" "batchplane-issuer" }}
{{- $volumes := dict }}
{{- range $i, $vol := (default list .fields.volumes) }}
{{- if has $vol.name $reservedVolumes }}
{{- fail (printf "%s.volumes[%d].name: %q is used by batchplane (%s are reserved)" $.at $i $vol.name (join ", " $reservedVolumes)) }}
{{- end }}
{{- $_ := set $volumes $vol.name true }}
{{- end }}
{{- range $i, $m := (default list .fields.volumeMounts) }}
{{- if has $m.name $reservedVolumes }}
{{- fail (printf "%s.volumeMounts[%d].name: %q is used by batchplane (%s are reserved)" $.at $i $m.name (join ", " $reservedVolumes)) }}
{{- end }}
{{- if not (hasKey $volumes $m.name) }}
{{- fail (printf "%s.volumeMounts[%d].name: %q names no volume of %s.volumes" $.at $i $m.name $.at) }}
{{- end }}
{{- $path := printf "/%s" (trimAll "/" (clean $m.mountPath)) }}
{{- if or (eq $path "/etc/batchplane") (eq $path "/tmp") (hasPrefix "/etc/batchplane/" $path) }}
{{- fail (printf "%s.volumeMounts[%d].mountPath: %q is used by batchplane (/etc/batchplane holds the job configuration, read-only; /tmp is its scratch space)" $.at $i $m.mountPath) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* job.yaml, as batchplane.core.config loads it. */}}
{{- define "batchplane.jobYaml" -}}
{{- $v := .Values }}
{{- $settings := deepCopy (default dict $v.job.settings) }}
{{- $sources := list }}
{{- $groups := list }}
{{- range $g := $v.sourceGroups }}
{{- $names := list }}
{{- range $s := $g.sources }}{{ $names = append $names $s.name }}{{ end }}
{{- $groups = append $groups $names }}
{{- range $s := $g.sources }}
{{- $src := dict "name" $s.name "path" $s.path }}
{{- if $s.tokenColumn }}{{ $_ := set $src "token_column" $s.tokenColumn }}{{ end }}
{{- if $s.transform }}{{ $_ := set $src "transform" $s.transform }}{{ end }}
{{- if $s.transformArgs }}{{ $_ := set $src "transform_args" $s.transformArgs }}{{ end }}
{{- if $s.columns }}{{ $_ := set $src "columns" $s.columns }}{{ end }}
{{- if hasKey $s "repeat" }}{{ $_ := set $src "repeat" (int $s.repeat) }}{{ end }}
{{- $sources = append $sources $src }}
{{- end }}
{{- end }}
{{- $job := dict
  "job" (default (include "batchplane.fullname" .) $v.job.name)
  "seed" (int64 $v.job.seed)
  "sources" $sources
  "mixture" $v.mixture
  "mesh" (dict "dp" (int $v.mesh.dp) "cp" (int $v.mesh.cp) "tp" (int $v.mesh.tp) "pp" (int $v.mesh.pp) "order" $v.mesh.order)
  "run_dir" (printf "%s/run" (include "batchplane.stateDir" .))
  "batch" (dict "global_batch_size" (int $v.batch.globalBatchSize) "microbatches" (int $v.batch.microbatches))
  "constructors" (dict "ranks_per_constructor" (int $v.trainer.ranksPerPod))
  "network" (include "batchplane.jobNetwork" . | fromYaml)
  "loaders" (dict "groups" $groups)
}}
{{- $_ := set $job "epochs" (ternary $v.job.epochs (int $v.job.epochs) (kindIs "string" $v.job.epochs)) }}
{{- if $v.strategy }}{{ $_ := set $job "strategy" $v.strategy }}{{ end }}
{{- $merged := mergeOverwrite $settings $job }}
{{- with $v.planner.ledger.location }}
{{- $_ := set $merged "ledger" (merge (dict "location" .) (default dict (get $merged "ledger"))) }}
{{- end }}
{{- toYaml $merged }}
{{- end }}

{{/* job.yaml's `network` as the chart sets it: every part binds all interfaces (a pod is reached
at its IP, probes and scrapes included); with tls.mode disabled, `tls: false` (network.tls off:
plaintext gRPC between pods, no identities), which needs tls.insecure: true to say it is meant. */}}
{{- define "batchplane.jobNetwork" -}}
host: 0.0.0.0
{{- if eq .Values.tls.mode "disabled" }}
{{- if not .Values.tls.insecure }}
{{- fail "tls.mode disabled serves plaintext gRPC on every pod's IP: anyone who reaches a pod could read training data and act as any part. Set tls.insecure: true to say you mean it (on a network nothing else can reach), or choose another tls.mode" }}
{{- end }}
tls: false
insecure: true
{{- end }}
{{- end }}

{{/* The job ConfigMap's data: job.yaml and the strategy files. */}}
{{- define "batchplane.jobConfigMapData" -}}
job.yaml: |
  {{- include "batchplane.jobYaml" . | nindent 2 }}
{{- range $name, $text := .Values.strategyFiles }}
{{ $name }}: |
  {{- $text | nindent 2 }}
{{- end }}
{{- end }}

{{/* ---- what trainer pods include -------------------------------------------------------- */}}

{{/* The constructor as a native sidecar: put it in the trainer pod's initContainers. */}}
{{- define "batchplane.constructorSidecar" -}}
{{- $port := int .Values.constructor.metricsPort -}}
- name: batchplane-constructor
  image: {{ include "batchplane.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  # A native sidecar: started before the trainer, kept running beside it, stopped after it.
  restartPolicy: Always
  # The image's entrypoint runs the part its first argument names (python -m batchplane.constructor).
  args:
    - constructor
    - -c
    - {{ include "batchplane.configDir" . }}/job.yaml
    # The pod's constructor index, worked out from the pod (batchplane.core.pod_rank) and
    # published for the trainer container.
    - --index-from
    - {{ .Values.constructor.indexFrom | quote }}
    - --publish-index
    - {{ include "batchplane.indexFile" . }}
    - --planner
    - {{ include "batchplane.plannerAddress" . }}
    - --listen
    - {{ include "batchplane.socketAddress" . }}
    - --metrics-port
    - {{ $port | quote }}
    {{- with include "batchplane.securityArgs" (dict "root" . "role" "constructor" "server" false) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
  env:
    {{- with include "batchplane.indexSourceEnv" . | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- include "batchplane.serviceEnv" . | nindent 4 }}
  ports:
    - name: bp-ctor-metrics
      containerPort: {{ $port }}
      protocol: TCP
  # /healthz on the metrics port answers 200 once the constructor's grpc.health.v1 is SERVING,
  # which it is only after it registered with the planner and serves on its socket, so the
  # trainer starts once its data is reachable.
  startupProbe:
    httpGet:
      path: {{ include "batchplane.healthPath" . }}
      port: {{ $port }}
    periodSeconds: 2
    failureThreshold: {{ max 1 (div (int .Values.constructor.startupTimeoutSeconds) 2) }}
  readinessProbe:
    httpGet:
      path: {{ include "batchplane.healthPath" . }}
      port: {{ $port }}
    periodSeconds: 10
  livenessProbe:
    httpGet:
      path: {{ include "batchplane.healthPath" . }}
      port: {{ $port }}
    periodSeconds: 20
    timeoutSeconds: 5
    failureThreshold: 6
  resources:
    {{- toYaml .Values.constructor.resources | nindent 4 }}
  securityContext:
    {{- include "batchplane.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: batchplane-socket
      mountPath: {{ include "batchplane.socketDir" . }}
    - name: batchplane-job
      mountPath: {{ include "batchplane.configDir" . }}
      readOnly: true
    - name: batchplane-tmp
      mountPath: /tmp
    {{- with include "batchplane.securityVolumeMounts" (dict "root" . "server" false) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
The volumes the sidecar needs: put them in the trainer pod's volumes. The socket folder is an
emptyDir that only the trainer container and the sidecar mount; the constructor makes its own
folder in it (mode 2770, group: the pod's fsGroup) before it binds, so the trainer must run with
the pod's fsGroup among its groups (batchplane.podSecurityContext sets it; it may run as another
UID). The sidecar's certificate and token Secrets (tls.mode issued, certManager or existingSecret: its
certificate emptyDir, the CA certificate and its projected ServiceAccount token, which the issuer
honours only for a pod whose serviceAccountName is batchplane.trainerServiceAccountName or one of
tls.issued.constructorServiceAccounts) are mounted in the sidecar only.
*/}}
{{- define "batchplane.volumes" -}}
- name: batchplane-socket
  emptyDir: {}
- name: batchplane-job
  configMap:
    name: {{ include "batchplane.jobConfigMapName" . }}
- name: batchplane-tmp
  emptyDir: {}
{{- with include "batchplane.securityVolumes" (dict "root" . "role" "constructor" "server" false) | trim }}
{{ . }}
{{- end }}
{{- end }}

{{/*
The variables constructor.indexFrom reads (batchplane.core.pod_rank), from the downward API: the
pod's name, labels and annotations its controller sets. `env:NAME` reads a variable of the
user's own, so it adds none.
*/}}
{{- define "batchplane.indexSourceEnv" -}}
{{- $source := .Values.constructor.indexFrom }}
{{- $fields := dict
  "BATCHPLANE_POD_NAME" "metadata.name"
  "BATCHPLANE_COMPLETION_INDEX" "metadata.annotations['batch.kubernetes.io/job-completion-index']"
  "BATCHPLANE_KUBEFLOW_REPLICA_TYPE" "metadata.labels['training.kubeflow.org/replica-type']"
  "BATCHPLANE_KUBEFLOW_REPLICA_INDEX" "metadata.labels['training.kubeflow.org/replica-index']"
  "BATCHPLANE_JOBSET_JOB_INDEX" "metadata.labels['jobset.sigs.k8s.io/job-index']"
  "BATCHPLANE_JOBSET_REPLICAS" "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"
  "BATCHPLANE_LWS_GROUP_INDEX" "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
  "BATCHPLANE_LWS_WORKER_INDEX" "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
  "BATCHPLANE_LWS_SIZE" "metadata.annotations['leaderworkerset.sigs.k8s.io/size']"
}}
{{- $sources := dict
  "indexed-job" (list "BATCHPLANE_COMPLETION_INDEX")
  "pod-ordinal" (list "BATCHPLANE_POD_NAME")
  "kubeflow" (list "BATCHPLANE_KUBEFLOW_REPLICA_TYPE" "BATCHPLANE_KUBEFLOW_REPLICA_INDEX")
  "jobset" (list "BATCHPLANE_JOBSET_JOB_INDEX" "BATCHPLANE_JOBSET_REPLICAS" "BATCHPLANE_COMPLETION_INDEX")
  "leaderworkerset" (list "BATCHPLANE_LWS_GROUP_INDEX" "BATCHPLANE_LWS_WORKER_INDEX" "BATCHPLANE_LWS_SIZE")
}}
{{- range $name := (get $sources $source | default list) }}
- name: {{ $name }}
  valueFrom:
    fieldRef:
      fieldPath: {{ get $fields $name }}
{{- end }}
{{- if eq $source "jobset" }}
- name: BATCHPLANE_TRAINER_PODS
  value: {{ include "batchplane.trainerPods" . | quote }}
{{- end }}
{{- end }}

{{/*
The trainer container's environment: where its constructor listens; the file where the sidecar
publishes the pod's constructor index before the trainer starts (BATCHPLANE_CONSTRUCTOR_INDEX_FILE,
for every index source); the index source and its inputs; and, where Kubernetes can give the
index itself (constructor.indexFrom indexed-job: the completion index), BATCHPLANE_CONSTRUCTOR_INDEX.
*/}}
{{- define "batchplane.trainerEnv" -}}
- name: BATCHPLANE_CONSTRUCTOR
  value: {{ include "batchplane.socketAddress" . }}
- name: BATCHPLANE_CONSTRUCTOR_INDEX_FILE
  value: {{ include "batchplane.indexFile" . }}
- name: BATCHPLANE_CONSTRUCTOR_INDEX_FROM
  value: {{ .Values.constructor.indexFrom | quote }}
{{- if eq .Values.constructor.indexFrom "indexed-job" }}
- name: BATCHPLANE_CONSTRUCTOR_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
{{- end }}
{{- with include "batchplane.indexSourceEnv" . | trim }}
{{ . }}
{{- end }}
{{- end }}

{{/* The trainer container's mounts: the folder holding the constructor's socket. */}}
{{- define "batchplane.trainerVolumeMounts" -}}
- name: batchplane-socket
  mountPath: {{ include "batchplane.socketDir" . }}
{{- end }}

{{/* Annotations of a trainer pod: scrape the sidecar, restart on a job change. */}}
{{- define "batchplane.trainerPodAnnotations" -}}
{{- with include "batchplane.scrapeAnnotations" (dict "root" . "port" (int .Values.constructor.metricsPort)) }}
{{- . }}
{{ end }}
{{- include "batchplane.configChecksum" . }}
{{- end }}

{{/* ---- network policy pieces ------------------------------------------------------------- */}}

{{- define "batchplane.networkPolicy.loaderSelector" -}}
app.kubernetes.io/component: loader
batchplane.dev/dataplane: {{ include "batchplane.fullname" . }}
{{- end }}

{{/* Any batchplane operator of the namespace (one serves every release there). */}}
{{- define "batchplane.networkPolicy.operatorSelector" -}}
app.kubernetes.io/name: {{ include "batchplane.name" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The Prometheus scraper's pods, as one peer (namespaceSelector AND podSelector). */}}
{{- define "batchplane.networkPolicy.prometheusPeer" -}}
{{- $p := .Values.networkPolicy.prometheus -}}
- namespaceSelector:
    {{- toYaml $p.namespaceSelector | nindent 4 }}
  podSelector:
    {{- toYaml $p.podSelector | nindent 4 }}
{{- end }}

{{/* Ingress from the scraper to a metrics port: (dict "root" . "port" 9100). */}}
{{- define "batchplane.networkPolicy.fromPrometheus" -}}
- from:
    {{- include "batchplane.networkPolicy.prometheusPeer" .root | nindent 4 }}
  ports:
    - port: {{ .port }}
      protocol: TCP
{{- end }}

{{/* Egress to the cluster DNS (UDP and TCP 53). */}}
{{- define "batchplane.networkPolicy.toDns" -}}
{{- $dns := .Values.networkPolicy.dns -}}
- to:
    - namespaceSelector:
        {{- toYaml $dns.namespaceSelector | nindent 8 }}
      podSelector:
        {{- toYaml $dns.podSelector | nindent 8 }}
    {{- range $dns.cidrs }}
    - ipBlock:
        cidr: {{ . }}
    {{- end }}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end }}

{{/* Egress to CIDRs on TCP ports: (dict "cidrs" list "ports" list); nothing when either is empty. */}}
{{- define "batchplane.networkPolicy.toCidrs" -}}
{{- if and .cidrs .ports -}}
- to:
    {{- range .cidrs }}
    - ipBlock:
        cidr: {{ . }}
    {{- end }}
  ports:
    {{- range .ports }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
{{- end }}
{{- end }}

{{/* Egress to the object store (networkPolicy.objectStore): sources, the ledger, the journal. */}}
{{- define "batchplane.networkPolicy.toObjectStore" -}}
{{- include "batchplane.networkPolicy.toCidrs" (dict "cidrs" .Values.networkPolicy.objectStore.cidrs "ports" .Values.networkPolicy.objectStore.ports) }}
{{- end }}

{{/* Egress to the planner's gRPC port. */}}
{{- define "batchplane.networkPolicy.toPlanner" -}}
- to:
    - podSelector:
        matchLabels:
          {{- include "batchplane.componentSelectorLabels" (dict "root" . "component" "planner") | nindent 10 }}
  ports:
    - port: {{ include "batchplane.plannerGrpcPort" . }}
      protocol: TCP
{{- end }}

{{/* Egress to this DataPlane's loaders' gRPC port. */}}
{{- define "batchplane.networkPolicy.toLoaders" -}}
- to:
    - podSelector:
        matchLabels:
          {{- include "batchplane.networkPolicy.loaderSelector" . | nindent 10 }}
  ports:
    - port: {{ include "batchplane.loaderGrpcPort" . }}
      protocol: TCP
{{- end }}

{{/* Egress to this release's operator's issuer port (batchplane.tlsIssued; nothing otherwise). */}}
{{- define "batchplane.networkPolicy.toIssuer" -}}
{{- if eq (include "batchplane.tlsIssued" .) "true" -}}
- to:
    - podSelector:
        matchLabels:
          {{- include "batchplane.componentSelectorLabels" (dict "root" . "component" "operator") | nindent 10 }}
  ports:
    - port: {{ int .Values.tls.issued.port }}
      protocol: TCP
{{- end }}
{{- end }}

{{/*
The egress rules a trainer pod's constructor sidecar needs: the planner's and the loaders' gRPC
ports, the operator's issuer port (tls.mode issued, certManager or existingSecret) and the cluster DNS. For a NetworkPolicy of your own trainer pods (policyTypes: [Egress]),
next to the rules the trainer itself needs (its peers, checkpoint storage, ...):
  egress: {{- include "batchplane.trainerEgressRules" $bp | nindent 4 }}
*/}}
{{- define "batchplane.trainerEgressRules" -}}
{{ include "batchplane.networkPolicy.toPlanner" . }}
{{ include "batchplane.networkPolicy.toLoaders" . }}
{{- with include "batchplane.networkPolicy.toIssuer" . | trim }}
{{ . }}
{{- end }}
{{ include "batchplane.networkPolicy.toDns" . }}
{{- end }}


{{/* ---- transport security: certificates and tokens ----------------------------------------- */}}

{{/* "true" when the parts speak mutual TLS between pods (tls.mode is not disabled). */}}
{{- define "batchplane.tlsEnabled" -}}{{ ne .Values.tls.mode "disabled" }}{{- end }}

{{/* The Secret of the chart's own CA (tls.mode issued, or certManager without an
issuerRef: the root; never with existingSecret, whose CA is yours); with tls.mode issued also the
ConfigMap of its certificate alone. */}}
{{- define "batchplane.tlsCaName" -}}
{{- include "batchplane.componentName" (dict "root" . "suffix" "ca") }}
{{- end }}

{{/* "true" when tls.mode certManager uses the chart's own CA (no tls.certManager.issuerRef). */}}
{{- define "batchplane.tlsOwnIssuer" -}}
{{- and (eq .Values.tls.mode "certManager") (not .Values.tls.certManager.issuerRef.name) }}
{{- end }}

{{/*
"true" when the operator issues each pod a certificate of its own. The modes differ only in the
CA it signs with (batchplane.issuerCaSecretName): tls.mode issued the CA Helm makes, certManager
the intermediate CA cert-manager issues and renews, existingSecret yours (tls.existingSecret.ca).
*/}}
{{- define "batchplane.tlsIssued" -}}{{ has .Values.tls.mode (list "issued" "certManager" "existingSecret") }}{{- end }}

{{/*
"true" when this release runs operator pods: to reconcile its DataPlane (operator.enabled), or,
with batchplane.tlsIssued and operator.enabled false (another release's operator reconciles it),
as its certificate issuer alone (--no-reconcile: no Prometheus, no Lease, no Deployments).
*/}}
{{- define "batchplane.operatorDeployed" -}}{{ or .Values.operator.enabled (eq (include "batchplane.tlsIssued" .) "true") }}{{- end }}

{{/*
The Secret of the CA the operator signs with (batchplane.tlsIssued; only the operator mounts it,
its tls.crt and tls.key as ca.crt and ca.key): tls.mode issued the Helm-made root `<name>-ca`;
certManager the intermediate `<name>-issuer-ca`; existingSecret yours, tls.existingSecret.ca (a
root or an intermediate). tls.crt: the CA and the CAs above it; ca.crt: the root.
*/}}
{{- define "batchplane.issuerCaSecretName" -}}
{{- if eq .Values.tls.mode "existingSecret" }}
{{- .Values.tls.existingSecret.ca }}
{{- else }}
{{- include "batchplane.componentName" (dict "root" . "suffix" (ternary "issuer-ca" "ca" (eq .Values.tls.mode "certManager"))) }}
{{- end }}
{{- end }}

{{/*
Where the parts read the trust anchor they verify the issuer and each other by (its key ca.crt,
nothing else), as YAML: `source` (the projected volume's source kind), `field` (the DataPlane's
spec.loader.identity field) and `name`. tls.mode issued: the ConfigMap `<name>-ca`, the CA's
certificate alone; certManager and existingSecret: the key ca.crt (the root) of the operator's CA
Secret, whose other keys the kubelet never projects.
*/}}
{{- define "batchplane.issuerTrustAnchor" -}}
{{- if eq .Values.tls.mode "issued" -}}
source: configMap
field: caConfigMap
name: {{ include "batchplane.tlsCaName" . }}
{{- else -}}
source: secret
field: caSecret
name: {{ include "batchplane.issuerCaSecretName" . }}
{{- end }}
{{- end }}

{{/* The operator's Service, which exposes its issuer port (batchplane.tlsIssued). */}}
{{- define "batchplane.operatorServiceName" -}}
{{- include "batchplane.componentName" (dict "root" . "suffix" "operator") }}
{{- end }}

{{/* The ClusterRole (and its binding) letting the operator review tokens (batchplane.tlsIssued):
cluster-scoped, so named after the namespace too. */}}
{{- define "batchplane.issuerClusterRoleName" -}}
{{- printf "%s-%s" .Release.Namespace (include "batchplane.componentName" (dict "root" . "suffix" "issuer")) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The issuer's address, as the parts dial it (--issuer): the operator Service's issuer port. */}}
{{- define "batchplane.issuerAddress" -}}
{{- printf "%s.%s.svc:%d" (include "batchplane.operatorServiceName" .) .Release.Namespace (int .Values.tls.issued.port) }}
{{- end }}

{{/*
The ServiceAccounts pods run as, whose pods the issuer gives a role (batchplane.tlsIssued): the
planner's and the loaders' (planner/loader.serviceAccountName, else `<name>-planner` and
`<name>-loader`, which the chart makes in these modes; other modes: the namespace's default, so
nothing), and the trainer pods' `<name>-trainer` (`default` in other modes, so a pod template may
always name it).
*/}}
{{- define "batchplane.plannerServiceAccountName" -}}
{{- if .Values.planner.serviceAccountName }}
{{- .Values.planner.serviceAccountName }}
{{- else if eq (include "batchplane.tlsIssued" .) "true" }}
{{- include "batchplane.componentName" (dict "root" . "suffix" "planner") }}
{{- end }}
{{- end }}

{{- define "batchplane.loaderServiceAccountName" -}}
{{- if .Values.loader.serviceAccountName }}
{{- .Values.loader.serviceAccountName }}
{{- else if eq (include "batchplane.tlsIssued" .) "true" }}
{{- include "batchplane.componentName" (dict "root" . "suffix" "loader") }}
{{- end }}
{{- end }}

{{- define "batchplane.trainerServiceAccountName" -}}
{{- if eq (include "batchplane.tlsIssued" .) "true" }}
{{- include "batchplane.componentName" (dict "root" . "suffix" "trainer") }}
{{- else -}}
default
{{- end }}
{{- end }}

{{/*
The roles the issuer gives, one `ROLE=SERVICEACCOUNT` per line (the operator's --issuer-role):
the planner's and the loaders' accounts, the trainer pods' and tls.issued.constructorServiceAccounts.
*/}}
{{- define "batchplane.issuerRoles" -}}
planner={{ include "batchplane.plannerServiceAccountName" . }}
loader={{ include "batchplane.loaderServiceAccountName" . }}
constructor={{ include "batchplane.trainerServiceAccountName" . }}
{{- range .Values.tls.issued.constructorServiceAccounts }}
constructor={{ . }}
{{- end }}
{{- end }}

{{/*
batchplane.tlsIssued, in a pod of a part: its certificate folder (--tls-dir), an in-memory
emptyDir of this pod only that the part writes its issued certificate and key into; and,
read-only, its projected ServiceAccount token for the issuer (audience tls.issued.audience,
renewed by the kubelet) beside the CA certificate (batchplane.issuerTrustAnchor: the key ca.crt
alone, never a key), files mode 0440.
*/}}
{{- define "batchplane.issuedVolumes" -}}
- name: batchplane-tls
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
- name: batchplane-issuer
  projected:
    defaultMode: 288
    sources:
      - serviceAccountToken:
          audience: {{ .Values.tls.issued.audience | quote }}
          expirationSeconds: {{ int .Values.tls.issued.tokenExpirationSeconds }}
          path: token
      {{- $anchor := include "batchplane.issuerTrustAnchor" . | fromYaml }}
      - {{ $anchor.source }}:
          name: {{ $anchor.name }}
          items:
            - key: ca.crt
              path: ca.crt
{{- end }}

{{/* The Secret of the per-role bearer tokens (auth.tokens). */}}
{{- define "batchplane.authTokensSecretName" -}}
{{- default (include "batchplane.componentName" (dict "root" . "suffix" "auth-tokens")) .Values.auth.tokens.existingSecret }}
{{- end }}

{{/*
"true" when the parts carry bearer tokens: auth.tokens.enabled, which only tls.mode disabled
takes (with certificates, each names its pod's own identity, which a token per role would undo).
*/}}
{{- define "batchplane.tokensEnabled" -}}
{{- and (ne (include "batchplane.tlsIssued" .) "true") .Values.auth.tokens.enabled }}
{{- end }}

{{/* The roles that have a token: one key each in the tokens Secret. */}}
{{- define "batchplane.tokenRoles" -}}planner loader constructor operator{{- end }}

{{/*
A part's flags for transport security: (dict "root" . "role" "planner" "server" true).
--tls-dir (unless tls.mode is disabled); with batchplane.tlsIssued --issuer (the operator's issuer
port), --issuer-token-file (the pod's projected ServiceAccount token) and --issuer-ca; with tokens (batchplane.tokensEnabled), a server (planner, loaders)
gets --auth-tokens (its own key of the tokens Secret and every role's verifier, `<role>.sha256`)
and presents its own key as --token-file, a caller only (the constructor) --token-file with its own key alone.
*/}}
{{- define "batchplane.securityArgs" -}}
{{- if eq (include "batchplane.tlsEnabled" .root) "true" }}
- --tls-dir
- {{ include "batchplane.tlsDir" .root }}
{{- end }}
{{- if eq (include "batchplane.tlsIssued" .root) "true" }}
- --issuer
- {{ include "batchplane.issuerAddress" .root }}
- --issuer-token-file
- {{ include "batchplane.issuerDir" .root }}/token
- --issuer-ca
- {{ include "batchplane.issuerDir" .root }}/ca.crt
{{- end }}
{{- if eq (include "batchplane.tokensEnabled" .root) "true" }}
{{- if .server }}
- --auth-tokens
- {{ include "batchplane.authTokensDir" .root }}
- --token-file
- {{ include "batchplane.authTokensDir" .root }}/{{ .role }}
{{- else }}
- --token-file
- {{ include "batchplane.tokenDir" .root }}/{{ .role }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A part's certificate and token volumes: (dict "root" . "role" "planner" "server" true). Secrets as
directories (never subPath, which never sees a renewed certificate), files readable by root and
the pod's fsGroup only (defaultMode 0440 = 288); a caller's token volume holds its own key only, a
server's its own key and the verifiers (items), never another role's token. With
batchplane.tlsIssued: batchplane.issuedVolumes, no Secret but the trust anchor's ca.crt key.
*/}}
{{- define "batchplane.securityVolumes" -}}
{{- if eq (include "batchplane.tlsIssued" .root) "true" }}
{{- include "batchplane.issuedVolumes" .root }}
{{- end }}
{{- if eq (include "batchplane.tokensEnabled" .root) "true" }}
{{- if .server }}
- name: batchplane-auth-tokens
  secret:
    secretName: {{ include "batchplane.authTokensSecretName" .root }}
    defaultMode: 288
    {{- /* its own token, and the verifiers (SHA-256) of the tokens it accepts: no other role's
    token, whether the chart made the Secret or you did (auth.tokens.existingSecret) */}}
    items:
      - key: {{ .role }}
        path: {{ .role }}
      {{- range $r := include "batchplane.tokenRoles" .root | splitList " " }}
      - key: {{ $r }}.sha256
        path: {{ $r }}.sha256
      {{- end }}
{{- else }}
- name: batchplane-token
  secret:
    secretName: {{ include "batchplane.authTokensSecretName" .root }}
    defaultMode: 288
    items:
      - key: {{ .role }}
        path: {{ .role }}
{{- end }}
{{- end }}
{{- end }}

{{/* Their mounts: (dict "root" . "server" true). */}}
{{- define "batchplane.securityVolumeMounts" -}}
{{- if eq (include "batchplane.tlsIssued" .root) "true" }}
- name: batchplane-tls
  mountPath: {{ include "batchplane.tlsDir" .root }}
- name: batchplane-issuer
  mountPath: {{ include "batchplane.issuerDir" .root }}
  readOnly: true
{{- end }}
{{- if eq (include "batchplane.tokensEnabled" .root) "true" }}
{{- if .server }}
- name: batchplane-auth-tokens
  mountPath: {{ include "batchplane.authTokensDir" .root }}
  readOnly: true
{{- else }}
- name: batchplane-token
  mountPath: {{ include "batchplane.tokenDir" .root }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/*
The chart's own CA (ECDSA P-256): (dict "root" . "found" <its Secret as `lookup` found it, or
nothing> "days" <validity> "out" (dict)). Renders nothing; sets out.ca (genCA's object: Cert and
Key, PEM) and out.kept (true when the found Secret's certificate and key are kept).
*/}}
{{- define "batchplane.tls.ca" -}}
{{- $data := get (.found | default dict) "data" | default dict }}
{{- if and (get $data "tls.crt") (get $data "tls.key") }}
{{- $_ := set .out "ca" (buildCustomCert (get $data "tls.crt") (get $data "tls.key")) }}
{{- $_ := set .out "kept" true }}
{{- else }}
{{- $_ := set .out "ca" (genCAWithKey (printf "%s batchplane CA" (include "batchplane.fullname" .root)) (int .days) (genPrivateKey "ecdsa")) }}
{{- $_ := set .out "kept" false }}
{{- end }}
{{- end }}

{{/* The CA's Secret `<name>-ca` (kubernetes.io/tls: tls.crt and tls.key, and ca.crt): (dict "root" . "ca" <genCA's object>). */}}
{{- define "batchplane.tls.caSecret" -}}
{{- $caCrt := .ca.Cert | b64enc }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ include "batchplane.tlsCaName" .root }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "batchplane.componentLabels" (dict "root" .root "component" "tls") | nindent 4 }}
type: kubernetes.io/tls
data:
  ca.crt: {{ $caCrt }}
  tls.crt: {{ $caCrt }}
  tls.key: {{ .ca.Key | b64enc }}
{{- end }}

{{/*
tls.mode issued: (dict "root" . "found" <the CA Secret as `lookup` found it, or nothing>). The CA
Secret `<name>-ca` (kept when found, so an upgrade keeps the CA; only the operator mounts it) and the ConfigMap `<name>-ca` with its certificate alone
(ca.crt), which the parts verify the issuer and each other by.
*/}}
{{- define "batchplane.tls.issuedCa" -}}
{{- $out := dict }}
{{- include "batchplane.tls.ca" (dict "root" .root "found" .found "days" .root.Values.tls.issued.caValidityDays "out" $out) }}
{{- include "batchplane.tls.caSecret" (dict "root" .root "ca" $out.ca) }}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "batchplane.tlsCaName" .root }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "batchplane.componentLabels" (dict "root" .root "component" "tls") | nindent 4 }}
data:
  ca.crt: |
    {{- $out.ca.Cert | trim | nindent 4 }}
{{- end }}

{{/*
The tokens Secret's data (batchplane.tokensEnabled without existingSecret): (dict "root" . "found"
<the Secret as lookup found it, or an empty dict>). One random 48-character token per role, each
kept when the found Secret has it, so an upgrade keeps them.
*/}}
{{- define "batchplane.auth.tokensData" -}}
{{- $old := get (.found | default dict) "data" | default dict }}
{{- range $role := include "batchplane.tokenRoles" .root | splitList " " }}
{{- $token := get $old $role | default (randAlphaNum 48 | b64enc) }}
{{ $role }}: {{ $token }}
{{ $role }}.sha256: {{ sha256sum (b64dec $token) | b64enc }}
{{- end }}
{{- end }}
