{{/* Names and labels. */}}
{{- define "lockgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "lockgate.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "lockgate.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The model's name on the bus: model.servedName, else model.name (a hub id is its own name). */}}
{{- define "lockgate.servedName" -}}
{{- default .Values.model.name .Values.model.servedName -}}
{{- end -}}

{{/* bus.base.safe_name: the served name on Kafka's topic alphabet [a-zA-Z0-9._-], at most 120 chars
     (the last ones). tests/deploy/test_chart.py checks it against the Python function. */}}
{{- define "lockgate.safeModel" -}}
{{- $s := regexReplaceAll "[^a-zA-Z0-9._-]+" (trim (include "lockgate.servedName" .)) "-" | trimAll "-." -}}
{{- if eq $s "" -}}{{- $s = "default" -}}{{- end -}}
{{- if gt (len $s) 120 -}}{{- $s = substr (int (sub (len $s) 120)) (len $s) $s -}}{{- end -}}
{{- $s -}}
{{- end -}}

{{/* bus.topics.TopicLayout (namespace "lockgate": the edge has no --namespace). */}}
{{- define "lockgate.topicNamespace" -}}lockgate{{- end -}}
{{- define "lockgate.requestTopic" -}}
{{- printf "%s.req.%s.p%d" (include "lockgate.topicNamespace" .root) (include "lockgate.safeModel" .root) (int .tier) -}}
{{- end -}}

{{/* engine_workers.worker.config.WorkerConfig.group: <ns>.workers.<safe model>. */}}
{{- define "lockgate.workerGroup" -}}
{{- printf "%s.workers.%s" (include "lockgate.topicNamespace" .) (include "lockgate.safeModel" .) -}}
{{- end -}}

{{/* The bus URL: security settings travel as LOCKGATE_KAFKA_* env, not in the URL. */}}
{{- define "lockgate.busURL" -}}
{{- $q := list -}}
{{- range $k, $v := .Values.kafka.options -}}{{- $q = append $q (printf "%s=%v" $k $v) -}}{{- end -}}
kafka://{{ .Values.kafka.bootstrap }}{{ if $q }}?{{ join "&" $q }}{{ end }}
{{- end -}}

{{- define "lockgate.sasl" -}}{{- hasPrefix "SASL_" .Values.kafka.securityProtocol -}}{{- end -}}
{{- define "lockgate.tls" -}}{{- has .Values.kafka.securityProtocol (list "SSL" "SASL_SSL") -}}{{- end -}}

{{/* Env of every lockgate container: the ConfigMap, the pod name, and the SASL username from a Secret. */}}
{{- define "lockgate.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if and (eq (include "lockgate.sasl" .) "true") .Values.kafka.sasl.usernameKey }}
- name: LOCKGATE_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.sasl.existingSecret }}
      key: {{ .Values.kafka.sasl.usernameKey }}
{{- end }}
{{- end -}}

{{- define "lockgate.envFrom" -}}
- configMapRef:
    name: {{ include "lockgate.fullname" . }}
{{- end -}}

{{/* Kafka credential mounts (password file, CA, client cert) and the model cache. */}}
{{- define "lockgate.kafkaVolumeMounts" -}}
{{- if eq (include "lockgate.sasl" .) "true" }}
- name: kafka-sasl
  mountPath: /etc/lockgate/kafka-sasl
  readOnly: true
{{- end }}
{{- if and (eq (include "lockgate.tls" .) "true") .Values.kafka.tls.caSecret }}
- name: kafka-ca
  mountPath: /etc/lockgate/kafka-ca
  readOnly: true
{{- end }}
{{- if and (eq (include "lockgate.tls" .) "true") .Values.kafka.tls.certSecret }}
- name: kafka-cert
  mountPath: /etc/lockgate/kafka-cert
  readOnly: true
{{- end }}
{{- end -}}

{{- define "lockgate.kafkaVolumes" -}}
{{- if eq (include "lockgate.sasl" .) "true" }}
- name: kafka-sasl
  secret:
    secretName: {{ required "kafka.sasl.existingSecret is required with a SASL securityProtocol" .Values.kafka.sasl.existingSecret }}
    items:
      - key: {{ .Values.kafka.sasl.passwordKey }}
        path: password
{{- end }}
{{- if and (eq (include "lockgate.tls" .) "true") .Values.kafka.tls.caSecret }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.tls.caSecret }}
    items:
      - key: {{ .Values.kafka.tls.caKey }}
        path: ca.crt
{{- end }}
{{- if and (eq (include "lockgate.tls" .) "true") .Values.kafka.tls.certSecret }}
- name: kafka-cert
  secret:
    secretName: {{ .Values.kafka.tls.certSecret }}
    items:
      - key: {{ .Values.kafka.tls.certKey }}
        path: tls.crt
      - key: {{ .Values.kafka.tls.keyKey }}
        path: tls.key
{{- end }}
{{- end -}}

{{- define "lockgate.cacheVolume" -}}
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "lockgate.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{- define "lockgate.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
