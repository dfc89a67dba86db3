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

{{/*
A hook that runs `scrubgate ARGS` in a Job, with an identity of its own: a ServiceAccount, a ClusterRole and a
Role (in the release's namespace) with their bindings, hooks of the same events made just before the Job
(weight -10) and deleted with it once it succeeded; a failed Job stays for its log.
  include "scrubgate.hook" (dict "root" $ "name" NAME "component" C "events" "pre-delete" "args" (list ...)
    "clusterRules" (list ...) "rules" (list ...) "backoffLimit" 0 "deadlineSeconds" 300)
*/}}
{{- define "scrubgate.hook" -}}
{{- $root := .root -}}
{{- $namespace := $root.Release.Namespace -}}
{{- $labels := dict "app.kubernetes.io/name" "scrubgate" "app.kubernetes.io/component" .component -}}
{{- $annotations := dict "helm.sh/hook" .events "helm.sh/hook-delete-policy" "before-hook-creation,hook-succeeded" -}}
{{- $identity := merge (dict "helm.sh/hook-weight" "-10") $annotations -}}
{{- $subjects := list (dict "kind" "ServiceAccount" "name" .name "namespace" $namespace) -}}
{{- $objects := list
  (dict "apiVersion" "v1" "kind" "ServiceAccount" "metadata" (dict "name" .name "namespace" $namespace))
  (dict "apiVersion" "rbac.authorization.k8s.io/v1" "kind" "ClusterRole" "metadata" (dict "name" .name) "rules" .clusterRules)
  (dict "apiVersion" "rbac.authorization.k8s.io/v1" "kind" "ClusterRoleBinding" "metadata" (dict "name" .name)
    "roleRef" (dict "apiGroup" "rbac.authorization.k8s.io" "kind" "ClusterRole" "name" .name) "subjects" $subjects)
  (dict "apiVersion" "rbac.authorization.k8s.io/v1" "kind" "Role" "metadata" (dict "name" .name "namespace" $namespace) "rules" .rules)
  (dict "apiVersion" "rbac.authorization.k8s.io/v1" "kind" "RoleBinding" "metadata" (dict "name" .name "namespace" $namespace)
    "roleRef" (dict "apiGroup" "rbac.authorization.k8s.io" "kind" "Role" "name" .name) "subjects" $subjects)
-}}
{{- range $objects }}
{{- $_ := set .metadata "labels" $labels }}
{{- $_ := set .metadata "annotations" $identity }}
---
{{ toYaml . }}
{{- end }}
{{- $pod := dict
  "metadata" (dict "labels" (deepCopy $labels))
  "spec" (dict
    "restartPolicy" "Never"
    "serviceAccountName" .name
    "securityContext" (dict "runAsNonRoot" true "runAsUser" 65532 "seccompProfile" (dict "type" "RuntimeDefault"))
    "containers" (list (dict
      "name" .component
      "image" (include "scrubgate.image" $root)
      "imagePullPolicy" $root.Values.image.pullPolicy
      "command" (list "scrubgate")
      "args" .args
      "securityContext" (dict "allowPrivilegeEscalation" false "readOnlyRootFilesystem" true "capabilities" (dict "drop" (list "ALL")))
      "resources" (dict "requests" (dict "cpu" "50m" "memory" "128Mi") "limits" (dict "memory" "256Mi")))))
-}}
{{- $_ := include "scrubgate.podValues" (dict "root" $root "pod" $pod "scheduling" true) }}
---
{{ toYaml (dict
  "apiVersion" "batch/v1"
  "kind" "Job"
  "metadata" (dict "name" .name "namespace" $namespace "labels" $labels "annotations" (merge (dict "helm.sh/hook-weight" "0") $annotations))
  "spec" (dict "backoffLimit" .backoffLimit "activeDeadlineSeconds" .deadlineSeconds "template" $pod)) }}
{{- end -}}
