{{/* Names and labels shared by every template. */}}

{{- define "memops.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "memops.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 53 | trimSuffix "-" }}
{{- else if contains (include "memops.name" .) .Release.Name }}
{{- .Release.Name | trunc 53 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "memops.name" .) | trunc 53 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "memops.selectorLabels" -}}
app.kubernetes.io/name: {{ include "memops.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "memops.labels" -}}
{{ include "memops.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "memops.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "memops.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "memops.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "memops.webhookServiceName" -}}
{{- printf "%s-webhook" (include "memops.fullname" .) }}
{{- end }}

{{- define "memops.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "memops.fullname" .) }}
{{- end }}

{{- define "memops.webhookCertificateName" -}}
{{- printf "%s-webhook" (include "memops.fullname" .) }}
{{- end }}

{{/*
What the operator does in a namespace it watches, as RBAC rules: the same list in the
ClusterRole (cluster-wide) and in each watched namespace's Role (namespaced mode).
tests/packaging/test_rbac.py checks it against the requests the operator really makes.
*/}}
{{- define "memops.namespacedRules" -}}
# memops' own resources: Kopf watches and patches them (finalizer, progress annotations).
- apiGroups: [memops.dev]
  resources: [memorypolicies, retirementrequests]
  verbs: [list, watch, patch]
# A policy's scale-downs and recycling are RetirementRequests it creates.
- apiGroups: [memops.dev]
  resources: [retirementrequests]
  verbs: [create]
- apiGroups: [memops.dev]
  resources: [memorypolicies/status, retirementrequests/status]
  verbs: [patch]
# Worker pods: listed by the workload's selector (and by node, for the room a resize may take), claimed and
# annotated (deletion cost, recycling, the node autoscalers' do-not-disrupt while a worker holds unique data).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, patch]
# Services: a scheduler address that names a Service of the namespace (tcp://dask-scheduler:8786)
# is dialled at the Service's cluster IP, as the namespace's pods reach it.
- apiGroups: [""]
  resources: [services]
  verbs: [get]
# Workloads: read (a Kopf index), scaled through /scale.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch]
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch]
# HPAs that scale a policy's workload directly: a Conflict condition (a Kopf index).
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, watch]
# Kubernetes Events on memops' objects; the kubelet's FailedPreStopHook events, read with a
# field selector, for a policy's status.safetyNet.
- apiGroups: [""]
  resources: [events]
  verbs: [create, list]
{{- if .Values.rbac.daskWorkerGroups }}
# rbac.daskWorkerGroups: dask-kubernetes' worker groups read, spec.worker.replicas lowered after a
# drain, and the drained workers' own Deployments deleted; each found from its pod through the
# pod's owner, the ReplicaSet.
- apiGroups: [kubernetes.dask.org]
  resources: [daskworkergroups]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [delete]
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [get]
{{- end }}
{{- if .Values.rbac.podResize }}
# rbac.podResize: a worker pod's memory resized in place (spec.resize), through the pod's resize
# subresource, the only way the API server takes a change of a running pod's resources.
- apiGroups: [""]
  resources: [pods/resize]
  verbs: [patch]
{{- end }}
{{- if .Values.rbac.schedulerTLS }}
# rbac.schedulerTLS: the client certificate of a tls:// scheduler (spec.scheduler.tls.secretName).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
{{- end }}

{{/*
The host directories that shared spill of medium Node may mount (memops run
--shared-spill-host-root), as a JSON list: sharedSpill.hostRoots, and the DaemonSet's hostPath when
it is on. One under another fails the install here, as the operator would refuse it when it starts.
The schema allows only plain paths (no trailing "/", no "." or ".." components), so a prefix that
ends in "/" compares whole components.
*/}}
{{- define "memops.sharedSpillHostRoots" -}}
{{- $roots := .Values.sharedSpill.hostRoots | default list }}
{{- if .Values.sharedSpill.nodeDaemonSet.enabled }}
{{- $roots = append $roots .Values.sharedSpill.nodeDaemonSet.hostPath }}
{{- end }}
{{- $roots = $roots | uniq | sortAlpha }}
{{- range $inner := $roots }}
{{- range $outer := $roots }}
{{- if hasPrefix (printf "%s/" $outer) $inner }}
{{- fail (printf "sharedSpill.hostRoots: %s lies under %s: allow one or the other" $inner $outer) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $roots }}
{{- end }}

{{/*
The webhook's client CA: the ConfigMap or Secret that holds it, as a volume source (empty: none).
Who may post admission reviews: a multi-tenant install (watchNamespaces) whose webhook any source
can reach (no client CA, and no NetworkPolicy peers) fails, unless
webhook.allowUnauthenticatedSources says so.
*/}}
{{- define "memops.webhookClientCA" -}}
{{- $ca := .Values.webhook.clientCA }}
{{- if and $ca.configMap $ca.secret }}
{{- fail "webhook.clientCA: name a configMap or a secret, not both" }}
{{- end }}
{{- if and .Values.webhook.clientNames (not (or $ca.configMap $ca.secret)) }}
{{- fail "webhook.clientNames are checked on a verified client certificate: set webhook.clientCA too" }}
{{- end }}
{{- if $ca.configMap }}
configMap:
  name: {{ $ca.configMap }}
  items: [{key: {{ $ca.key | quote }}, path: ca.crt}]
{{- else if $ca.secret }}
secret:
  secretName: {{ $ca.secret }}
  items: [{key: {{ $ca.key | quote }}, path: ca.crt}]
{{- end }}
{{- end }}

{{- define "memops.webhookSourcesGuard" -}}
{{- $ca := .Values.webhook.clientCA }}
{{- $peers := and .Values.networkPolicy.enabled .Values.webhook.networkPolicy.from }}
{{- if and .Values.webhook.enabled .Values.watchNamespaces (not (or $ca.configMap $ca.secret $peers .Values.webhook.allowUnauthenticatedSources)) }}
{{- fail "watchNamespaces is set (a multi-tenant install), but the webhook is open to every source: no webhook.clientCA, and no webhook.networkPolicy.from (or networkPolicy.enabled is false). Any pod could then post admission reviews that the eviction gate acts on. Set webhook.clientCA (the API server's client certificate for webhooks, see docs/install.md), or webhook.networkPolicy.from to the API server's source, or webhook.allowUnauthenticatedSources=true to install it open anyway" }}
{{- end }}
{{- end }}
