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

{{/* The kvxferd container; the same in both modes. Copy it into your own pod spec to run
     kvxferd as a sidecar of an existing inference workload. */}}
{{- define "kvxferd.container" -}}
- name: kvxferd
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["serve", "--config", "/etc/kvxferd/kvxferd.toml"]
  env:
    - name: KVXFERD_ADVERTISE_HOST
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
  ports:
    - name: side-channel
      containerPort: {{ .Values.config.sideChannelPort }}
      protocol: TCP
    - name: metrics
      containerPort: {{ .Values.config.metricsPort }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /readyz
      port: metrics
    periodSeconds: 5
  livenessProbe:
    httpGet:
      path: /healthz
      port: metrics
    periodSeconds: 10
    failureThreshold: 6
  resources:
    {{- toYaml .Values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: socket
      mountPath: /run/kvxferd
    - name: config
      mountPath: /etc/kvxferd
      readOnly: true
    - name: tmp
      mountPath: /tmp
{{- end -}}
