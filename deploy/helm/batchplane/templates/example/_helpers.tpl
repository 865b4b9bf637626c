{{/*
Pieces of the example trainers (example.kind). Each pod includes the constructor sidecar and the
trainer environment exactly as a user's own pod template would (deploy/helm/README.md, "Feeding a
trainer"), with constructor.indexFrom matching the kind.
*/}}

{{/* Name of the example's resources. */}}
{{- define "batchplane.example.name" -}}
{{- include "batchplane.componentName" (dict "root" . "suffix" "example") }}
{{- end }}

{{- define "batchplane.example.image" -}}
{{- printf "%s:%s" (default .Values.image.repository .Values.example.image.repository) (default (default .Chart.AppVersion .Values.image.tag) .Values.example.image.tag) }}
{{- end }}

{{/* The port torchrun's static rendezvous (the master's TCP store) listens on. */}}
{{- define "batchplane.example.rendezvousPort" -}}29500{{- end }}

{{/*
The trainer container's securityContext: the chart's lockdown, but as example.runAsUser and
example.runAsGroup, not the sidecar's UID, so the example shows that the trainer reaches the
constructor's socket through the pod's fsGroup alone.
*/}}
{{- define "batchplane.example.trainerSecurityContext" -}}
{{- $ctx := include "batchplane.containerSecurityContext" . | fromYaml }}
{{- $_ := set $ctx "runAsUser" (int .Values.example.runAsUser) }}
{{- $_ := set $ctx "runAsGroup" (int .Values.example.runAsGroup) }}
{{- toYaml $ctx }}
{{- end }}

{{/* Metadata of an example trainer pod template. */}}
{{- define "batchplane.example.podMetadata" -}}
labels:
  {{- include "batchplane.componentLabels" (dict "root" . "component" "trainer") | nindent 2 }}
  {{- include "batchplane.trainerLabels" . | nindent 2 }}
annotations:
  {{- include "batchplane.trainerPodAnnotations" . | nindent 2 }}
{{- end }}

{{/*
torchrun over every trainer pod, one process per rank of the pod. Static rendezvous: the node rank
is the constructor index the sidecar published, so torchrun's RANK (node rank x ranksPerPod +
local rank) is a rank this pod's constructor serves. (A c10d rendezvous would hand out node ranks
in arrival order, which need not match.) Each rank reads its batches with
batchplane.examples.timed_trainer. (dict "root" . "master" "<host>" "port" "<port>").
*/}}
{{- define "batchplane.example.torchrunScript" -}}
{{- $root := .root -}}
set -eu
index=$(cat "$BATCHPLANE_CONSTRUCTOR_INDEX_FILE")
echo "constructor index $index ($BATCHPLANE_CONSTRUCTOR_INDEX_FROM), master {{ .master }}:{{ .port }}"
torchrun --nnodes={{ include "batchplane.trainerPods" $root }} --nproc-per-node={{ int $root.Values.trainer.ranksPerPod }} \
  --node-rank="$index" --rdzv-backend=static --master-addr="{{ .master }}" --master-port="{{ .port }}" \
  --no-python sh -c 'exec python -m batchplane.examples.timed_trainer --ranks "$RANK" --step-seconds 0.05 --out "/tmp/steps-$RANK.jsonl"'
{{- if .thenSleep }}
# A LeaderWorkerSet's pods are a StatefulSet's: they restart whatever the exit status, so the
# trainer waits once done.
exec sleep infinity
{{- end }}
{{- end }}

{{/*
The pod spec of an example trainer: the sidecar, one trainer container, the sidecar's volumes.
(dict "root" . "container" "trainer" "restartPolicy" "Never" "script" "..." "ports" list "subdomain" "").
*/}}
{{- define "batchplane.example.podSpec" -}}
{{- $root := .root -}}
serviceAccountName: {{ include "batchplane.trainerServiceAccountName" $root }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .restartPolicy }}
restartPolicy: {{ . }}
{{- end }}
{{- with .subdomain }}
subdomain: {{ . }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "batchplane.podSecurityContext" $root | nindent 2 }}
initContainers:
  {{- include "batchplane.constructorSidecar" $root | nindent 2 }}
containers:
  - name: {{ .container }}
    image: {{ include "batchplane.example.image" $root | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command: [sh, -c]
    args:
      - |
        {{- .script | nindent 8 }}
    env:
      {{- include "batchplane.trainerEnv" $root | nindent 6 }}
      - name: PYTHONUNBUFFERED
        value: "1"
      - name: HOME
        value: /tmp
    {{- with .ports }}
    ports:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    resources:
      {{- toYaml $root.Values.example.resources | nindent 6 }}
    securityContext:
      {{- include "batchplane.example.trainerSecurityContext" $root | nindent 6 }}
    volumeMounts:
      {{- include "batchplane.trainerVolumeMounts" $root | nindent 6 }}
      - name: trainer-tmp
        mountPath: /tmp
volumes:
  {{- include "batchplane.volumes" $root | nindent 2 }}
  - name: trainer-tmp
    emptyDir: {}
{{- end }}
