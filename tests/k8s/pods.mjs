// Turns a rendered kustomization into the processes Kubernetes would start,
// for running them on this machine (tests/k8s_pods_test.sh): for each pod,
// each container's argv and environment with what the kubelet substitutes
// (the downward API: pod name, pod IP = 127.0.0.1; ConfigMap and Secret
// values; $(VAR) in command and args), and what a cluster gives that one
// machine does not, translated: every Service name -> 127.0.0.1 (a headless
// Service's POD.SERVICE -> that pod's ports), every container port -> a
// free local port of its own (a pod has its own network namespace), every
// volume -> a directory (a mount's subPath: a directory in it; ConfigMap
// and Secret volumes written as the kubelet writes them: ..data symlinks,
// defaultMode), every mount path in an argument or value -> that directory.
//
// Usage: node pods.mjs KUSTOMIZATION_DIR OUT_DIR [--pods WORKLOAD=N]... [--secret NAME=DIR]... [--cpu-cap N]
//   --pods: how many pods of a workload (default: its replicas)
//   --secret: a Secret's keys, one file per key in DIR
//   --cpu-cap: CPU quantities the downward API gives (resourceFieldRef) at
//     most N: the machines a pod's limit counts on are not this one
// Writes OUT_DIR/pods.tsv (workload, pod name, terminationGracePeriodSeconds,
// in start order: StatefulSets, then Deployments) and, per pod,
// OUT_DIR/POD/{init-N,main}.{argv,env} (NUL-separated). Exit 2 with one line
// on anything it cannot translate.
import fs from "node:fs";
import path from "node:path";
import net from "node:net";
import crypto from "node:crypto";
import { render } from "./kustomize.mjs";

function die(msg) {
  console.error(`pods.mjs: ${msg}`);
  process.exit(2);
}

const [dir, outArg, ...rest] = process.argv.slice(2);
const out = outArg && path.resolve(outArg);
if (!dir || !outArg) die("usage: node pods.mjs KUSTOMIZATION_DIR OUT_DIR [--pods WORKLOAD=N]... [--secret NAME=DIR]...");
const podCounts = {}, secrets = {};
let cpuCap = Infinity;
for (let i = 0; i < rest.length; i += 2) {
  const [k, v] = (rest[i + 1] ?? "").split("=");
  if (rest[i] === "--cpu-cap" && Number(k) > 0) cpuCap = Number(k);
  else if (rest[i] === "--pods" && v) podCounts[k] = Number(v);
  else if (rest[i] === "--secret" && v) secrets[k] = v;
  else die(`bad argument '${rest[i]} ${rest[i + 1] ?? ""}'`);
}

let objects;
try {
  objects = render(dir);
} catch (e) {
  die(e.message);
}
const find = (kind, name) => objects.find((o) => o.kind === kind && o.metadata?.name === name);

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const p = s.address().port;
      s.close(() => resolve(p));
    });
  });
}

const alphabet = "bcdfghjklmnpqrstvwxz2456789"; // the one Kubernetes names pods with
const safe = (bytes, n) => [...bytes].slice(0, n).map((b) => alphabet[b % alphabet.length]).join("");

function cpuQuantity(q) {
  const s = String(q);
  return s.endsWith("m") ? Number(s.slice(0, -1)) / 1000 : Number(s);
}
function memQuantity(q) {
  const m = /^(\d+(?:\.\d+)?)([KMGT]i?)?$/.exec(String(q));
  if (!m) die(`memory quantity '${q}' not understood`);
  const mult = { K: 1e3, M: 1e6, G: 1e9, T: 1e12, Ki: 1024, Mi: 1024 ** 2, Gi: 1024 ** 3, Ti: 1024 ** 4 }[m[2]] ?? 1;
  return Number(m[1]) * mult;
}

// Workloads in start order, with their pods.
const pods = [];
for (const kind of ["StatefulSet", "Deployment"]) {
  for (const o of objects.filter((x) => x.kind === kind)) {
    const n = podCounts[o.metadata.name] ?? o.spec.replicas ?? 1;
    const hash = safe(crypto.createHash("sha256").update(JSON.stringify(o.spec.template)).digest(), 10);
    for (let i = 0; i < n; i++) {
      const podName = kind === "StatefulSet" ? `${o.metadata.name}-${i}` : `${o.metadata.name}-${hash}-${safe(crypto.randomBytes(5), 5)}`;
      pods.push({ workload: o, podName, labels: o.spec.template.metadata?.labels ?? {}, spec: o.spec.template.spec, ports: new Map() });
    }
  }
}
for (const p of pods)
  for (const c of [...(p.spec.initContainers ?? []), ...p.spec.containers])
    for (const cp of c.ports ?? []) if (!p.ports.has(cp.containerPort)) p.ports.set(cp.containerPort, { name: cp.name, local: await freePort() });

const selects = (svc, p) => Object.entries(svc.spec?.selector ?? {}).every(([k, v]) => p.labels[k] === v) && svc.spec?.selector;
const esc = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

// A Service name (and its namespace-qualified forms) with a Service port ->
// 127.0.0.1 and the local port of the container port it targets.
// A headless Service also names each pod of the StatefulSet it governs
// (POD.SERVICE): that pod's own port, before the Service's own name.
function serviceRewrites(p) {
  const rules = [];
  for (const svc of objects.filter((o) => o.kind === "Service")) {
    const targets = pods.filter((t) => selects(svc, t));
    const qualified = `(?:\\.[a-z0-9-]+(?:\\.svc(?:\\.cluster\\.local)?)?)?`;
    const host = `${esc(svc.metadata.name)}${qualified}`;
    const headless = svc.spec.clusterIP === "None";
    for (const sp of svc.spec.ports ?? []) {
      const tp = sp.targetPort ?? sp.port;
      const portOf = (t) => {
        const entry = [...t.ports.entries()].find(([num, v]) => (typeof tp === "number" ? num === tp : v.name === tp));
        if (!entry) die(`Service ${svc.metadata.name} port ${sp.port}: no container port ${tp} in ${t.podName}`);
        return entry[1].local;
      };
      if (headless)
        for (const t of targets.filter((x) => x.workload.kind === "StatefulSet" && x.workload.spec.serviceName === svc.metadata.name))
          rules.push([new RegExp(`(?<![\\w.-])${esc(t.podName)}\\.${host}:${sp.port}(?!\\d)`, "g"), `127.0.0.1:${portOf(t)}`]);
      if (targets[0]) rules.push([new RegExp(`(?<![\\w.-])${host}:${sp.port}(?!\\d)`, "g"), `127.0.0.1:${portOf(targets[0])}`]);
    }
    if (headless)
      for (const t of targets.filter((x) => x.workload.kind === "StatefulSet" && x.workload.spec.serviceName === svc.metadata.name))
        rules.push([new RegExp(`(?<![\\w.-])${esc(t.podName)}\\.${host}(?![\\w-])`, "g"), "127.0.0.1"]);
    rules.push([new RegExp(`(?<![\\w.-])${host}(?![\\w-])`, "g"), "127.0.0.1"]);
  }
  return rules;
}

function translate(s, p, mounts) {
  s = String(s);
  // This pod's own ports: in a listen address, or a port given alone.
  if (p.ports.has(Number(s)) && /^\d+$/.test(s)) return String(p.ports.get(Number(s)).local);
  s = s.replace(/((?:0\.0\.0\.0|127\.0\.0\.1|\*|\[::\]):)(\d+)(?!\d)/g, (all, pre, port) => (p.ports.has(Number(port)) ? pre + p.ports.get(Number(port)).local : all));
  for (const [re, to] of serviceRewrites(p)) s = s.replace(re, to);
  for (const [mountPath, hostDir] of mounts) s = s.replace(new RegExp(`(^|[=\\s:,])${esc(mountPath)}(?=/|$|[\\s,:])`, "g"), `$1${hostDir}`);
  return s;
}

function expand(s, env) {
  // Kubernetes: $(VAR) is replaced when VAR is defined, $$ escapes, else kept.
  return String(s).replace(/\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (all, v) => (all === "$$" ? "$" : v in env ? env[v] : all));
}

function secretDir(name) {
  const d = secrets[name];
  if (!d) die(`Secret ${name} is not in the manifests (created by the user): give its keys with --secret ${name}=DIR`);
  return d;
}

function writeAtomic(volDir, files, mode) {
  // The kubelet's layout: ..TIMESTAMP/KEY files, ..data -> ..TIMESTAMP, KEY -> ..data/KEY.
  const ts = "..2026_01_01_00_00_00.000000001";
  fs.mkdirSync(path.join(volDir, ts), { recursive: true });
  for (const [rel, content] of files) {
    const f = path.join(volDir, ts, rel);
    fs.mkdirSync(path.dirname(f), { recursive: true });
    fs.writeFileSync(f, content);
    fs.chmodSync(f, mode);
  }
  fs.symlinkSync(ts, path.join(volDir, "..data"));
  for (const [rel] of files) fs.symlinkSync(path.join("..data", rel), path.join(volDir, rel.split("/")[0]));
}

function volumeDir(p, v) {
  const d = path.join(out, p.podName, "vol", v.name);
  if (v.emptyDir) fs.mkdirSync(d, { recursive: true });
  else if (v.configMap) {
    const cm = find("ConfigMap", v.configMap.name) ?? die(`ConfigMap ${v.configMap.name} not found`);
    const items = v.configMap.items ?? Object.keys(cm.data ?? {}).map((k) => ({ key: k, path: k }));
    fs.mkdirSync(d, { recursive: true });
    writeAtomic(d, items.map((it) => [it.path, cm.data[it.key]]), v.configMap.defaultMode ?? 0o644);
  } else if (v.secret) {
    const src = secretDir(v.secret.secretName);
    const keys = v.secret.items ?? fs.readdirSync(src).map((k) => ({ key: k, path: k }));
    fs.mkdirSync(d, { recursive: true });
    writeAtomic(d, keys.map((it) => [it.path, fs.readFileSync(path.join(src, it.key))]), v.secret.defaultMode ?? 0o644);
  } else if (v.persistentVolumeClaim) {
    const shared = path.join(out, "pvc", v.persistentVolumeClaim.claimName);
    fs.mkdirSync(shared, { recursive: true });
    return shared;
  } else die(`${p.podName}: volume ${v.name} of a kind this test does not translate`);
  return d;
}

function podEnv(p, c) {
  const env = {};
  const wl = p.workload;
  for (const ef of c.envFrom ?? []) {
    if (ef.secretRef) {
      const src = secretDir(ef.secretRef.name);
      for (const k of fs.readdirSync(src)) env[(ef.prefix ?? "") + k] = fs.readFileSync(path.join(src, k), "utf8");
    } else if (ef.configMapRef) {
      const cm = find("ConfigMap", ef.configMapRef.name) ?? die(`ConfigMap ${ef.configMapRef.name} not found`);
      for (const [k, v] of Object.entries(cm.data ?? {})) env[(ef.prefix ?? "") + k] = v;
    }
  }
  for (const e of c.env ?? []) {
    const vf = e.valueFrom;
    if (!vf) env[e.name] = expand(e.value ?? "", env);
    else if (vf.fieldRef) {
      const f = vf.fieldRef.fieldPath;
      const known = { "metadata.name": p.podName, "metadata.namespace": "default", "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1" };
      if (!(f in known)) die(`${p.podName}: env ${e.name}: fieldRef ${f} not translated`);
      env[e.name] = known[f];
    } else if (vf.resourceFieldRef) {
      const r = vf.resourceFieldRef;
      const target = [...(p.spec.initContainers ?? []), ...p.spec.containers].find((x) => x.name === (r.containerName ?? c.name));
      const [kind, res] = r.resource.split(".");
      const q = target?.resources?.[kind]?.[res] ?? die(`${p.podName}: env ${e.name}: ${r.resource} not set (the kubelet would give the machine's)`);
      const v = res === "cpu" ? Math.min(cpuQuantity(q), cpuCap) / cpuQuantity(r.divisor ?? "1") : memQuantity(q) / memQuantity(r.divisor ?? "1");
      env[e.name] = String(Math.ceil(v));
    } else if (vf.configMapKeyRef) {
      const cm = find("ConfigMap", vf.configMapKeyRef.name) ?? die(`ConfigMap ${vf.configMapKeyRef.name} not found`);
      env[e.name] = cm.data?.[vf.configMapKeyRef.key] ?? die(`ConfigMap ${vf.configMapKeyRef.name} has no ${vf.configMapKeyRef.key}`);
    } else if (vf.secretKeyRef) {
      env[e.name] = fs.readFileSync(path.join(secretDir(vf.secretKeyRef.name), vf.secretKeyRef.key), "utf8");
    } else die(`${wl.metadata.name}: env ${e.name}: valueFrom not translated`);
  }
  return env;
}

// A mount's subPath: a directory inside the volume, made when missing (as the kubelet does).
function subPathDir(volDir, subPath) {
  if (!subPath) return volDir;
  if (path.isAbsolute(subPath) || subPath.split("/").includes("..")) die(`subPath '${subPath}' must be a relative path inside the volume`);
  const d = path.join(volDir, subPath);
  fs.mkdirSync(d, { recursive: true });
  return d;
}

fs.mkdirSync(out, { recursive: true });
const lines = [];
for (const p of pods) {
  const vols = new Map();
  for (const v of p.spec.volumes ?? []) vols.set(v.name, volumeDir(p, v));
  for (const t of p.workload.spec.volumeClaimTemplates ?? []) {
    const d = path.join(out, "pvc", `${t.metadata.name}-${p.podName}`);
    fs.mkdirSync(d, { recursive: true });
    vols.set(t.metadata.name, d);
  }
  const containers = [...(p.spec.initContainers ?? []).map((c, i) => [`init-${i}`, c]), ["main", p.spec.containers[0]]];
  if (p.spec.containers.length !== 1) die(`${p.podName}: one container per pod expected, found ${p.spec.containers.length}`);
  for (const [tag, c] of containers) {
    if (!c.command) die(`${p.podName}: container ${c.name} has no command (the image's entrypoint is not known here)`);
    const mounts = (c.volumeMounts ?? [])
      .map((m) => [m.mountPath, subPathDir(vols.get(m.name) ?? die(`${p.podName}: mount ${m.name}: no volume`), m.subPath)])
      .sort((a, b) => b[0].length - a[0].length);
    const env = podEnv(p, c);
    const argv = [...c.command, ...(c.args ?? [])].map((s) => translate(expand(s, env), p, mounts));
    const envList = Object.entries(env).map(([k, v]) => `${k}=${translate(v, p, mounts)}`);
    fs.mkdirSync(path.join(out, p.podName), { recursive: true });
    fs.writeFileSync(path.join(out, p.podName, `${tag}.argv`), argv.map((a) => a + "\0").join(""));
    fs.writeFileSync(path.join(out, p.podName, `${tag}.env`), envList.map((a) => a + "\0").join(""));
  }
  lines.push([p.workload.metadata.name, p.podName, p.spec.terminationGracePeriodSeconds ?? 30].join("\t"));
}
fs.writeFileSync(path.join(out, "pods.tsv"), lines.join("\n") + "\n");
