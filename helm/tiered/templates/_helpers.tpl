{{/*
Names, labels and images shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "tiered.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource name prefix: fullnameOverride, else <release>-<chart> (just the
release name when it already contains the chart name). Kept to 40 characters so
that "<fullname>-agent-datacenter" and similar still fit the 63 of a label value.
*/}}
{{- define "tiered.fullname" -}}
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

{{- define "tiered.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "tiered.labels" -}}
helm.sh/chart: {{ include "tiered.chart" . }}
app.kubernetes.io/name: {{ include "tiered.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tiered
{{- end }}

{{/*
Selector labels of one component. Call with (dict "ctx" $ "component" "router").
They never change between upgrades: selectors are immutable.
*/}}
{{- define "tiered.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tiered.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of one component's objects: the common ones plus its selector labels. */}}
{{- define "tiered.componentLabels" -}}
{{ include "tiered.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
An image reference. Call with (dict "ctx" $ "image" .Values.images.agent);
an empty tag means the chart's appVersion.
*/}}
{{- define "tiered.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "tiered.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create }}
{{- default (printf "%s-controller" (include "tiered.fullname" .)) .Values.controller.serviceAccount.name }}
{{- else }}
{{- required "controller.serviceAccount.name is required when controller.serviceAccount.create is false" .Values.controller.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tiered.routingConfigMap" -}}
{{- printf "%s-routing" (include "tiered.fullname" .) }}
{{- end }}

{{- define "tiered.routerService" -}}
{{- printf "%s-router" (include "tiered.fullname" .) }}
{{- end }}

{{/*
The TLS Secret of one component (router, controller or agents): tls.secrets.<component>,
else tls.secretName, else the one the chart generates (tls-secrets.yaml). Either
every component's Secret is named (directly or by secretName) or none is: certificates
of one release chain to one CA. Call with (dict "ctx" . "component" "router").
*/}}
{{- define "tiered.tlsSecretName" -}}
{{- $tls := .ctx.Values.tls -}}
{{- $named := get ($tls.secrets | default dict) .component | default $tls.secretName -}}
{{- if $named -}}
{{- $named -}}
{{- else if include "tiered.tlsGenerated" .ctx -}}
{{- printf "%s-%s-tls" (include "tiered.fullname" .ctx) .component -}}
{{- else -}}
{{- fail "tls: name a Secret for every component (tls.secrets.router, .controller, .agents, or tls.secretName for the rest), or none to have the chart generate them" -}}
{{- end -}}
{{- end }}

{{/* "true" when TLS is on and no Secret is named: the chart makes a CA and a key pair per component. */}}
{{- define "tiered.tlsGenerated" -}}
{{- $tls := .Values.tls -}}
{{- if and $tls.enabled (not $tls.secretName) (not (values ($tls.secrets | default dict) | compact)) -}}
true
{{- end -}}
{{- end }}

{{/* The name agents are checked against: tls.serverName, else the one in the generated agents' certificate. */}}
{{- define "tiered.tlsServerName" -}}
{{- if .Values.tls.serverName -}}
{{- .Values.tls.serverName -}}
{{- else if include "tiered.tlsGenerated" . -}}
{{- printf "%s-agents.%s.svc" (include "tiered.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end }}

{{/* volumeMounts every container shares: scratch /tmp and, with TLS, its component's Secret. */}}
{{- define "tiered.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/tiered/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* volumes every pod shares, matching tiered.commonVolumeMounts. Call with (dict "ctx" . "component" "router"). */}}
{{- define "tiered.commonVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "tiered.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/*
Environment every container shares. HOME points at the writable /tmp because
the root filesystem is read-only and libraries (torch, pip caches) write there.
*/}}
{{- define "tiered.commonEnv" -}}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{/*
Transport security flags of a component: TLS from the mounted Secret, or an
explicit --insecure (the binaries refuse to guess). Servers add
--tls-client-auth when tls.clientAuth is on. Call with (dict "ctx" . "server" true).
*/}}
{{- define "tiered.tlsArgs" -}}
{{- if .ctx.Values.tls.enabled }}
- --tls-cert
- /etc/tiered/tls/tls.crt
- --tls-key
- /etc/tiered/tls/tls.key
- --tls-ca
- /etc/tiered/tls/ca.crt
{{- if and .server .ctx.Values.tls.clientAuth }}
- --tls-client-auth
{{- end }}
{{- with include "tiered.tlsServerName" .ctx }}
- --tls-server-name
- {{ . | quote }}
{{- end }}
{{- else }}
- --insecure
{{- end }}
{{- end }}

{{/*
A probe of the gRPC port: Kubernetes' native gRPC probe speaks plaintext only,
so under TLS the port itself is probed.
*/}}
{{- define "tiered.grpcProbe" -}}
{{- if .Values.tls.enabled }}
tcpSocket:
  port: 8001
{{- else }}
grpc:
  port: 8001
{{- end }}
{{- end }}

{{/*
TopologySpreadConstraints of one component's pods: a constraint without a
labelSelector gets the component's selector labels. Call with
(dict "ctx" $ "component" "router" "constraints" .Values.router.topologySpreadConstraints).
*/}}
{{- define "tiered.topologySpreadConstraints" -}}
{{- $selector := include "tiered.selectorLabels" . | fromYaml }}
{{- $constraints := list }}
{{- range .constraints }}
{{- $constraint := deepCopy . }}
{{- if not (hasKey $constraint "labelSelector") }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
{{- $constraints = append $constraints $constraint }}
{{- end }}
{{- toYaml $constraints }}
{{- end }}

{{/*
The pod settings of one component: priorityClassName and topologySpreadConstraints.
Call with (dict "ctx" $ "component" "router" "values" .Values.router).
*/}}
{{- define "tiered.podPlacement" -}}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- include "tiered.topologySpreadConstraints" (dict "ctx" $.ctx "component" $.component "constraints" .) | nindent 2 }}
{{- end }}
{{- end }}

{{- define "tiered.agentPodsConfigMap" -}}
{{- printf "%s-agent-pods" (include "tiered.fullname" .) }}
{{- end }}

{{/*
The controller's settings of the agent pods it creates (`tiered controller
--agent-pods`, tiered.controller.kube.render.AgentPods): the release's labels,
the REST port, and each tier's settings with tiers.<tier> resolved over the
common ones (a key set for the tier replaces the common value).
*/}}
{{- define "tiered.agentPods" -}}
{{- $agents := .Values.agents -}}
labels:
  app.kubernetes.io/name: {{ include "tiered.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
  app.kubernetes.io/part-of: tiered
httpPort: {{ if $agents.http.enabled }}8000{{ else }}null{{ end }}
tiers:
{{- range $tier := list "edge" "regional" "datacenter" }}
{{- $override := index ($agents.tiers | default dict) $tier | default dict }}
{{- $common := dict
      "priorityClassName" $agents.priorityClassName
      "runtimeClassName" (has $tier (list "regional" "datacenter") | ternary $agents.gpuRuntimeClassName "")
      "topologySpreadConstraints" $agents.topologySpreadConstraints
      "extraArgs" $agents.extraArgs
      "extraEnv" $agents.extraEnv }}
{{- $resolved := dict }}
{{- range $key, $value := $common }}
{{- $_ := set $resolved $key (hasKey $override $key | ternary (index $override $key) $value) }}
{{- end }}
  {{ $tier }}:
    {{- toYaml $resolved | nindent 4 }}
{{- end }}
placement:
  {{- toYaml $agents.placement | nindent 2 }}
{{- with include "tiered.agentAuth" . }}
auth:
  {{- . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The token Secrets the agents require (AgentPods.auth: inference, admin), or
nothing when none is named, so that a release without them renders as before.
Agents that require an inference token need the router to present one: it
does not pass its clients' tokens on.
*/}}
{{- define "tiered.agentAuth" -}}
{{- $auth := .Values.agents.auth -}}
{{- $files := dict -}}
{{- if $auth.inferenceTokenSecret -}}
{{- if not .Values.router.auth.agentTokenSecret -}}
{{- fail "agents.auth.inferenceTokenSecret: the agents then take inference only with a token, and the router presents none (it does not pass a client's token on): set router.auth.agentTokenSecret to a Secret holding one of the agents' tokens" -}}
{{- end -}}
{{- $_ := set $files "inference" (dict "secret" $auth.inferenceTokenSecret "key" $auth.inferenceTokenKey) -}}
{{- end -}}
{{- if $auth.adminTokenSecret -}}
{{- $_ := set $files "admin" (dict "secret" $auth.adminTokenSecret "key" $auth.adminTokenKey) -}}
{{- end -}}
{{- with $files }}{{ toYaml . }}{{ end -}}
{{- end }}

{{/* The agents' token Secrets, which their pods may mount (controller-workload-policy.yaml). */}}
{{- define "tiered.agentTokenSecrets" -}}
{{- $auth := .Values.agents.auth -}}
{{- list $auth.inferenceTokenSecret $auth.adminTokenSecret | compact | toJson -}}
{{- end }}

{{/*
The router's token files, each one key of a Secret mounted read-only at
/etc/tiered/tokens/<name>: a JSON list of {name, flag, secret, key}.
*/}}
{{- define "tiered.routerTokens" -}}
{{- $auth := .Values.router.auth -}}
{{- $files := list -}}
{{- if $auth.inferenceTokenSecret -}}
{{- $files = append $files (dict "name" "inference-tokens" "flag" "--inference-token-file" "secret" $auth.inferenceTokenSecret "key" $auth.inferenceTokenKey) -}}
{{- end -}}
{{- if $auth.agentTokenSecret -}}
{{- $files = append $files (dict "name" "agent-token" "flag" "--agent-token-file" "secret" $auth.agentTokenSecret "key" $auth.agentTokenKey) -}}
{{- end -}}
{{- toJson $files -}}
{{- end }}
