{{/*
The objects of a YAML file under files/ as {"docs": [...]}: one map per document with a kind. Use with
  (fromYaml (include "scrubgate.docs" (dict "root" $ "file" "files/manifests/rbac.yaml"))).docs
*/}}
{{- define "scrubgate.docs" -}}
{{- $content := .root.Files.Get .file -}}
{{- if not $content -}}
{{- fail (printf "scrubgate chart: %s is missing or empty; the chart reads the kustomize base through files/ (links into the repository): package it with `helm package` from a checkout" .file) -}}
{{- end -}}
{{- $docs := list -}}
{{- range $chunk := regexSplit "(?m)^---[ \\t]*$" $content -1 -}}
{{- $doc := fromYaml $chunk -}}
{{- if hasKey $doc "Error" -}}
{{- fail (printf "scrubgate chart: %s: %s" $.file $doc.Error) -}}
{{- end -}}
{{- if $doc.kind -}}
{{- $docs = append $docs $doc -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "docs" $docs) -}}
{{- end -}}

{{/* The image every container runs: one image for the webhook, the agent and the reports. */}}
{{- define "scrubgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
`args` with the value after `flag` replaced by `value` (the flag appended when absent), as JSON:
  fromJsonArray (include "scrubgate.setArg" (dict "args" $args "flag" "--port" "value" "8443"))
*/}}
{{- define "scrubgate.setArg" -}}
{{- $out := list -}}
{{- $replace := false -}}
{{- $found := false -}}
{{- range $arg := .args -}}
{{- if $replace -}}
{{- $out = append $out (toString $.value) -}}
{{- $replace = false -}}
{{- else -}}
{{- $out = append $out $arg -}}
{{- if eq (toString $arg) $.flag -}}
{{- $replace = true -}}
{{- $found = true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $found -}}
{{- $out = concat $out (list $.flag (toString $.value)) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
Sets, on a pod template (a workload's spec.template, or a Pod), what every pod of the chart takes from the
values: podAnnotations and podLabels (merged under its own), imagePullSecrets and priorityClassName; and, with
"scheduling", the webhook's nodeSelector, tolerations and the node part of its affinity, for the pods that run
once beside it (the uninstall hook, helm test: tainted nodes or a node pool of its own hold them too; its pod
(anti-)affinity and spread constraints are about its replicas). Returns nothing:
  $_ := include "scrubgate.podValues" (dict "root" $ "pod" $template "scheduling" true)
*/}}
{{- define "scrubgate.podValues" -}}
{{- $values := .root.Values -}}
{{- $pod := .pod -}}
{{- $_ := set $pod "metadata" ($pod.metadata | default dict) -}}
{{- $_ := set $pod.metadata "annotations" (merge ($pod.metadata.annotations | default dict) $values.podAnnotations) -}}
{{- if not $pod.metadata.annotations -}}{{- $_ := unset $pod.metadata "annotations" -}}{{- end -}}
{{- $_ := set $pod.metadata "labels" (merge ($pod.metadata.labels | default dict) $values.podLabels) -}}
{{- with $values.imagePullSecrets -}}{{- $_ := set $pod.spec "imagePullSecrets" . -}}{{- end -}}
{{- with $values.priorityClassName -}}{{- $_ := set $pod.spec "priorityClassName" . -}}{{- end -}}
{{- if .scheduling -}}
{{- with $values.webhook.nodeSelector -}}{{- $_ := set $pod.spec "nodeSelector" . -}}{{- end -}}
{{- with $values.webhook.tolerations -}}{{- $_ := set $pod.spec "tolerations" . -}}{{- end -}}
{{- with $values.webhook.affinity.nodeAffinity -}}{{- $_ := set $pod.spec "affinity" (dict "nodeAffinity" .) -}}{{- end -}}
{{- end -}}
{{- end -}}
