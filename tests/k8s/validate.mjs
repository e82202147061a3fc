// Validates deploy/kubernetes offline: every object of every YAML file, and
// every kustomization rendered (tests/k8s/kustomize.mjs), against the
// Kubernetes API schemas (npm kubernetes-models: every built-in kind;
// @kubernetes-models/prometheus-operator: PodMonitor, PrometheusRule), plus
// checks the API server or the kubelet would make at apply or pod start:
// the selector matches the template's labels, every mount names a volume,
// every $(VAR) in command/args names an env entry defined before it, every
// ConfigMap, PVC and Service the objects refer to is in the same kustomization,
// every StatefulSet pod named through its headless Service (POD-I.SERVICE)
// is one of its replicas.
// Unknown fields are refused too (tests/k8s/strict_fields.mjs). Where kubectl
// is installed, each rendering is compared with `kubectl kustomize`
// (DTACTOR_K8S_COMPARE_KUBECTL=0: not).
// Usage: node tests/k8s/validate.mjs [DIR] (default deploy/kubernetes).
// Prints one line per problem and exits 1 if there is any.
import fs from "node:fs";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { isDeepStrictEqual } from "node:util";
import { fileURLToPath } from "node:url";
import { loadYamlDocs, render, kustomizations } from "./kustomize.mjs";
import { unknownFields } from "./strict_fields.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(process.argv[2] ?? path.join(here, "../../deploy/kubernetes"));
const problems = [];
const say = (where, msg) => problems.push(`${where}: ${msg}`);
const rel = (p) => path.relative(process.cwd(), p) || ".";

async function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const spec = group === "monitoring.coreos.com"
    ? `@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`
    : `kubernetes-models/${group ? group + "/" : ""}${version}/${kind}`;
  try {
    const mod = await import(spec);
    return mod[kind] ?? null;
  } catch {
    return null;
  }
}

const name = (o) => `${o?.kind ?? "?"}/${o?.metadata?.name ?? "?"}`;

async function checkObject(o, where) {
  if (o === null || typeof o !== "object" || Array.isArray(o)) return say(where, "a document that is not an object");
  if (typeof o.apiVersion !== "string" || typeof o.kind !== "string") return say(where, "no apiVersion or kind");
  if (!o.metadata?.name) say(`${where}: ${name(o)}`, "no metadata.name");
  const Model = await modelFor(o.apiVersion, o.kind);
  if (!Model) return say(`${where}: ${name(o)}`, `unknown kind ${o.kind} of ${o.apiVersion} (not in kubernetes-models or the Prometheus Operator's models)`);
  try {
    new Model(o).validate();
  } catch (e) {
    say(`${where}: ${name(o)}`, e.message);
  }
  for (const f of unknownFields(o)) say(`${where}: ${name(o)}`, `unknown field ${f}`);
}

function podSpecOf(o) {
  return o.spec?.template?.spec ?? o.spec?.jobTemplate?.spec?.template?.spec ?? null;
}

// What the API server and the kubelet would refuse in a rendered set.
function checkReferences(objects, where) {
  const has = (kind, n) => objects.some((o) => o.kind === kind && o.metadata?.name === n);
  for (const o of objects) {
    const w = `${where}: ${name(o)}`;
    const spec = podSpecOf(o);
    if (!spec) continue;
    const labels = o.spec.template?.metadata?.labels ?? {};
    for (const [k, v] of Object.entries(o.spec.selector?.matchLabels ?? {}))
      if (labels[k] !== v) say(w, `selector ${k}=${v} does not match the pod template's labels`);
    if (o.kind === "StatefulSet" && o.spec.serviceName && !has("Service", o.spec.serviceName)) say(w, `serviceName ${o.spec.serviceName}: no such Service here`);
    const volumes = new Set([...(spec.volumes ?? []).map((v) => v.name), ...(o.spec.volumeClaimTemplates ?? []).map((t) => t.metadata?.name)]);
    for (const v of spec.volumes ?? []) {
      if (v.configMap && !v.configMap.optional && !has("ConfigMap", v.configMap.name)) say(w, `volume ${v.name}: no ConfigMap ${v.configMap.name} here`);
      if (v.persistentVolumeClaim && !has("PersistentVolumeClaim", v.persistentVolumeClaim.claimName)) say(w, `volume ${v.name}: no PersistentVolumeClaim ${v.persistentVolumeClaim.claimName} here`);
      if (v.configMap?.items) {
        const cm = objects.find((c) => c.kind === "ConfigMap" && c.metadata?.name === v.configMap.name);
        for (const it of v.configMap.items) if (cm && !(it.key in (cm.data ?? {}))) say(w, `volume ${v.name}: ConfigMap ${v.configMap.name} has no key ${it.key}`);
      }
    }
    const containers = [...(spec.initContainers ?? []), ...(spec.containers ?? [])];
    for (const c of containers) {
      const cw = `${w}: container ${c.name}`;
      for (const m of c.volumeMounts ?? []) if (!volumes.has(m.name)) say(cw, `volumeMount ${m.name}: no such volume`);
      const defined = [];
      for (const e of c.env ?? []) {
        const ref = e.valueFrom?.configMapKeyRef;
        if (ref && !ref.optional) {
          const cm = objects.find((x) => x.kind === "ConfigMap" && x.metadata?.name === ref.name);
          if (!cm) say(cw, `env ${e.name}: no ConfigMap ${ref.name} here`);
          else if (!(ref.key in (cm.data ?? {}))) say(cw, `env ${e.name}: ConfigMap ${ref.name} has no key ${ref.key}`);
        }
        const rf = e.valueFrom?.resourceFieldRef;
        if (rf && rf.containerName && !containers.some((x) => x.name === rf.containerName)) say(cw, `env ${e.name}: no container ${rf.containerName}`);
        defined.push(e.name);
      }
      // Kubernetes leaves $(VAR) as it is when VAR is not defined: a silent bug.
      for (const s of [...(c.command ?? []), ...(c.args ?? [])])
        for (const m of String(s).matchAll(/(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g))
          if (!defined.includes(m[1])) say(cw, `'${s}' refers to $(${m[1]}), which is not in its env`);
      for (const s of [...(c.command ?? []), ...(c.args ?? []), ...(c.env ?? []).map((e) => e.value ?? "")])
        for (const why of podNameProblems(objects, String(s))) say(cw, why);
    }
  }
}

// A StatefulSet pod's DNS name (POD-I.SERVICE, its headless Service) that
// names a pod the StatefulSet does not have: nothing refuses it, and the
// name never resolves.
function podNameProblems(objects, text) {
  const out = [];
  for (const m of text.matchAll(/(?<![\w.-])([a-z0-9-]+)-(\d+)\.([a-z0-9-]+)(?![\w-])/g)) {
    const [, set, index, service] = m;
    const svc = objects.find((o) => o.kind === "Service" && o.metadata?.name === service);
    const sts = objects.find((o) => o.kind === "StatefulSet" && o.metadata?.name === set && o.spec?.serviceName === service);
    if (!svc || !sts) continue;
    const replicas = sts.spec.replicas ?? 1;
    if (Number(index) >= replicas) out.push(`'${text}' names pod ${set}-${index}, but StatefulSet ${set} has ${replicas} replica(s)`);
    if (svc.spec?.clusterIP !== "None") out.push(`'${text}' names pod ${set}-${index} through Service ${service}, which is not headless (no per-pod names)`);
  }
  return out;
}

function byKey(objects) {
  const m = new Map();
  for (const o of objects) m.set(`${o.kind}/${o.metadata?.namespace ?? ""}/${o.metadata?.name}`, o);
  return m;
}

function kubectlAvailable() {
  try {
    execFileSync("kubectl", ["version", "--client"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

if (!fs.existsSync(root)) {
  console.log(`${root}: no such directory`);
  process.exit(2);
}
let files = 0, objects = 0;
const walk = async (d) => {
  for (const e of fs.readdirSync(d, { withFileTypes: true })) {
    const p = path.join(d, e.name);
    if (e.isDirectory()) await walk(p);
    else if (/\.ya?ml$/.test(e.name) && e.name !== "kustomization.yaml") {
      files++;
      let docs;
      try {
        docs = loadYamlDocs(p);
      } catch (err) {
        say(rel(p), `not valid YAML: ${err.message.split("\n")[0]}`);
        continue;
      }
      for (const o of docs) {
        objects++;
        await checkObject(o, rel(p));
      }
    }
  }
};
await walk(root);

const compareWanted = process.env.DTACTOR_K8S_COMPARE_KUBECTL !== "0";
const compare = compareWanted && kubectlAvailable();
const dirs = kustomizations(root);
for (const d of dirs) {
  let out;
  try {
    out = render(d);
  } catch (err) {
    say(rel(d), err.message);
    continue;
  }
  for (const o of out) await checkObject(o, `${rel(d)} (rendered)`);
  checkReferences(out, `${rel(d)} (rendered)`);
  if (compare) {
    let theirs;
    try {
      theirs = byKey(loadYamlDocsFromString(execFileSync("kubectl", ["kustomize", d], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] })));
    } catch (err) {
      say(rel(d), `kubectl kustomize failed: ${String(err.stderr ?? err.message).trim().split("\n").pop()}`);
      continue;
    }
    const ours = byKey(out);
    for (const k of new Set([...ours.keys(), ...theirs.keys()]))
      if (!isDeepStrictEqual(ours.get(k), theirs.get(k))) say(rel(d), `${k} differs between tests/k8s/kustomize.mjs and kubectl kustomize`);
  }
}

function loadYamlDocsFromString(text) {
  const tmp = path.join(fs.mkdtempSync(path.join(process.env.TMPDIR ?? "/tmp", "k8s-validate-")), "out.yaml");
  fs.writeFileSync(tmp, text);
  try {
    return loadYamlDocs(tmp);
  } finally {
    fs.rmSync(path.dirname(tmp), { recursive: true, force: true });
  }
}

for (const p of problems) console.log(p);
const how = compare
  ? "renderings equal to kubectl kustomize"
  : compareWanted ? "kubectl not found: renderings not compared with kustomize" : "renderings not compared with kustomize (DTACTOR_K8S_COMPARE_KUBECTL=0)";
if (problems.length) {
  console.log(`k8s validate: ${problems.length} problem(s) in ${rel(root)}`);
  process.exit(1);
}
console.log(`k8s validate: ${objects} object(s) in ${files} file(s) and ${dirs.length} kustomization(s) valid (${how})`);
