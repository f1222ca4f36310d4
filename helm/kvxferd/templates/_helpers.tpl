{{- define "kvxferd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvxferd.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvxferd.labels" -}}
app.kubernetes.io/name: {{ include "kvxferd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvxferd.selector" -}}
app.kubernetes.io/name: {{ include "kvxferd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The engine socket. daemonset: in the host directory socketHostPath (made kvxferd's by the
     init container). sidecar: the shared emptyDir is world-writable (0777), which the daemon
     refuses as the socket's directory, so the socket lives in a directory the daemon creates
     inside it (0750, docs/deploy.md "The engine socket"). */}}
{{- define "kvxferd.socketPath" -}}
{{- if eq .Values.mode "sidecar" -}}
/run/kvxferd/daemon/kvxferd.sock
{{- else -}}
/run/kvxferd/kvxferd.sock
{{- end -}}
{{- end -}}

{{/* Where the Curve keys come from ("secret" or "hostPath", "" for none); fails the render when
     the side channel would listen beyond loopback with no keys and no explicit
     config.sideChannelInsecure. */}}
{{- define "kvxferd.curveSecret" -}}
{{- $host := .Values.config.sideChannelHost | toString -}}
{{- $loopback := or (hasPrefix "127." $host) (eq $host "::1") (eq $host "localhost") -}}
{{- if not (or .Values.curve.existingSecret .Values.curve.hostPath .Values.config.sideChannelInsecure $loopback) -}}
{{- fail (printf `

kvxferd: curve.existingSecret (or curve.hostPath) is required. The side channel listens on %s:%v, and without
CurveZMQ keys any host that reaches it could handshake and read the KV blocks kvxferd holds.
Create one keypair for the daemons that talk to each other and a Secret holding it:

  kvxferd keys generate ./kvxferd-curve --name kvxferd
  kubectl -n %s create secret generic kvxferd-curve --from-file=./kvxferd-curve

then install with --set curve.existingSecret=kvxferd-curve (the other daemons' releases too).
Per-node keys instead: make them on each node (kvxferd keys generate /etc/kvxferd/curve --owner 10001,
each peer's public key copied into /etc/kvxferd/curve/authorized) and --set curve.hostPath=/etc/kvxferd/curve.
On a network where every host may read the KV cache: --set config.sideChannelInsecure=true.
` $host .Values.config.sideChannelPort .Release.Namespace) -}}
{{- end -}}
{{- if .Values.curve.hostPath -}}hostPath{{- else if .Values.curve.existingSecret -}}secret{{- end -}}
{{- end -}}

{{/* Where the probes reach the metrics server from inside the container (an IPv6 address in
     brackets, as a URL wants it). */}}
{{- define "kvxferd.probeHost" -}}
{{- $host := .Values.config.metricsHost | toString -}}
{{- if has $host (list "" "0.0.0.0" "*") -}}127.0.0.1
{{- else if eq $host "::" -}}[::1]
{{- else if contains ":" $host -}}[{{ $host }}]
{{- else -}}{{ $host }}{{- end -}}
{{- end -}}

{{/* "true" when the metrics listen on loopback alone: nothing off the node can scrape them. */}}
{{- define "kvxferd.metricsLoopback" -}}
{{- $host := .Values.config.metricsHost | toString -}}
{{- if or (hasPrefix "127." $host) (eq $host "::1") (eq $host "localhost") -}}true{{- end -}}
{{- end -}}

{{/* Volumes both modes mount into the kvxferd container (the socket volume differs). */}}
{{- define "kvxferd.volumes" -}}
- name: config
  configMap:
    name: {{ include "kvxferd.fullname" . }}
{{- $keys := include "kvxferd.curveSecret" . }}
{{- if eq $keys "hostPath" }}
- name: curve
  hostPath:
    path: {{ .Values.curve.hostPath }}
    type: Directory
{{- else if eq $keys "secret" }}
- name: curve
  secret:
    secretName: {{ .Values.curve.existingSecret }}
    defaultMode: 0440
{{- end }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{/* The kvxferd container; the same in both modes. Copy it into your own pod spec to run
     kvxferd as a sidecar of an existing inference workload. */}}
{{- define "kvxferd.container" -}}
- name: kvxferd
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["serve", "--config", "/etc/kvxferd/kvxferd.toml"]
  # What the image's environment sets (socket, side channel, Curve keys, metrics, log format) is
  # set here: the environment overrides kvxferd.toml.
  env:
    - name: KVXFERD_ADVERTISE_HOST
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    - name: KVXFERD_SOCKET_PATH
      value: {{ include "kvxferd.socketPath" . | quote }}
    - name: KVXFERD_SIDE_CHANNEL_HOST
      value: {{ .Values.config.sideChannelHost | quote }}
    - name: KVXFERD_SIDE_CHANNEL_INSECURE
      value: {{ .Values.config.sideChannelInsecure | toString | quote }}
    {{- if include "kvxferd.curveSecret" . }}
    - name: KVXFERD_CURVE_SECRET_KEY_FILE
      value: "/etc/kvxferd/curve/{{ .Values.curve.secretKeyName }}"
    - name: KVXFERD_CURVE_AUTHORIZED_KEYS_DIR
      value: {{ if .Values.curve.hostPath }}/etc/kvxferd/curve/authorized{{ else }}/etc/kvxferd/curve{{ end }}
    {{- with .Values.curve.serverKeyName }}
    - name: KVXFERD_CURVE_SERVER_KEY_FILE
      value: "/etc/kvxferd/curve/{{ . }}"
    {{- end }}
    {{- else }}
    - name: KVXFERD_CURVE_SECRET_KEY_FILE
      value: ""
    - name: KVXFERD_CURVE_AUTHORIZED_KEYS_DIR
      value: ""
    {{- end }}
    - name: KVXFERD_METRICS_HOST
      value: {{ .Values.config.metricsHost | quote }}
    - name: KVXFERD_LOG_FORMAT
      value: {{ .Values.config.logFormat | quote }}
  ports:
    - name: side-channel
      containerPort: {{ .Values.config.sideChannelPort }}
      protocol: TCP
    - name: metrics
      containerPort: {{ .Values.config.metricsPort }}
      protocol: TCP
  # In the container: the metrics server may listen on loopback alone (config.metricsHost)
  readinessProbe:
    exec:
      command: ["python3", "-c", "import urllib.request as u; u.urlopen('http://{{ include "kvxferd.probeHost" . }}:{{ .Values.config.metricsPort }}/readyz', timeout=3)"]
    periodSeconds: 5
    timeoutSeconds: 4
  livenessProbe:
    exec:
      command: ["python3", "-c", "import urllib.request as u; u.urlopen('http://{{ include "kvxferd.probeHost" . }}:{{ .Values.config.metricsPort }}/healthz', timeout=3)"]
    periodSeconds: 10
    timeoutSeconds: 4
    failureThreshold: 6
  resources:
    {{- toYaml .Values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: socket
      mountPath: /run/kvxferd
    - name: config
      mountPath: /etc/kvxferd/kvxferd.toml
      subPath: kvxferd.toml
      readOnly: true
    {{- if include "kvxferd.curveSecret" . }}
    - name: curve
      mountPath: /etc/kvxferd/curve
      readOnly: true
    {{- end }}
    - name: tmp
      mountPath: /tmp
{{- end -}}
