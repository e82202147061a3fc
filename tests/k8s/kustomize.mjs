// The part of kustomize that deploy/kubernetes uses, so that the checks run
// where no kubectl is installed: `resources` (files and directories holding a
// kustomization.yaml), `patches` as JSON 6902 operations (inline `patch` or
// `path`) with a `target` of kind and name, and `images`. Anything else in a
// kustomization is refused, naming it, rather than ignored. k8s_validate
// compares the result with `kubectl kustomize` where kubectl is installed.
import fs from "node:fs";
import path from "node:path";
import yaml from "js-yaml";

const known = new Set(["apiVersion", "kind", "resources", "patches", "images"]);

export function loadYamlDocs(file) {
  const docs = yaml.loadAll(fs.readFileSync(file, "utf8"), null, { filename: file });
  return docs.filter((d) => d !== null && d !== undefined);
}

function fail(msg) {
  throw new Error(msg);
}

// JSON pointer (RFC 6901) into `doc`: returns [parent, key].
function locate(doc, pointer, where) {
  if (!pointer.startsWith("/")) fail(`${where}: path '${pointer}' must start with /`);
  const parts = pointer.slice(1).split("/").map((p) => p.replace(/~1/g, "/").replace(/~0/g, "~"));
  let cur = doc;
  for (let i = 0; i < parts.length - 1; i++) {
    const key = Array.isArray(cur) ? Number(parts[i]) : parts[i];
    if (cur === null || typeof cur !== "object" || !(key in cur)) fail(`${where}: path '${pointer}' does not exist (at '${parts[i]}')`);
    cur = cur[key];
  }
  return [cur, parts[parts.length - 1]];
}

export function applyJson6902(doc, ops, where) {
  if (!Array.isArray(ops)) fail(`${where}: only JSON 6902 patches (a list of operations) are supported`);
  for (const op of ops) {
    const [parent, key] = locate(doc, op.path, where);
    if (parent === null || typeof parent !== "object") fail(`${where}: path '${op.path}' has no parent object`);
    if (op.op === "add") {
      if (Array.isArray(parent)) {
        if (key === "-") parent.push(op.value);
        else parent.splice(Number(key), 0, op.value);
      } else parent[key] = op.value;
    } else if (op.op === "replace" || op.op === "remove") {
      const k = Array.isArray(parent) ? Number(key) : key;
      if (!(k in parent)) fail(`${where}: ${op.op} of '${op.path}', which does not exist`);
      if (op.op === "replace") parent[k] = op.value;
      else if (Array.isArray(parent)) parent.splice(k, 1);
      else delete parent[k];
    } else fail(`${where}: operation '${op.op}' is not supported (add, replace, remove)`);
  }
}

function setImages(obj, images) {
  const spec = obj?.spec?.template?.spec ?? obj?.spec?.jobTemplate?.spec?.template?.spec;
  if (!spec) return;
  for (const c of [...(spec.containers ?? []), ...(spec.initContainers ?? [])]) {
    for (const im of images) {
      const m = /^([^@:]+(?::\d+\/[^@:]+)?)(?::([^@]+))?(@.*)?$/.exec(c.image ?? "");
      if (!m || m[1] !== im.name) continue;
      const name = im.newName ?? m[1];
      const tag = im.digest ? `@${im.digest}` : im.newTag ? `:${im.newTag}` : m[2] ? `:${m[2]}` : "";
      c.image = name + tag;
    }
  }
}

// Renders the kustomization in `dir`: a list of objects, in resource order.
export function render(dir, seen = []) {
  dir = path.resolve(dir);
  if (seen.includes(dir)) fail(`kustomization cycle: ${[...seen, dir].join(" -> ")}`);
  const file = path.join(dir, "kustomization.yaml");
  if (!fs.existsSync(file)) fail(`${dir}: no kustomization.yaml`);
  const k = yaml.load(fs.readFileSync(file, "utf8"), { filename: file }) ?? {};
  for (const key of Object.keys(k)) if (!known.has(key)) fail(`${file}: '${key}' is not supported by tests/k8s/kustomize.mjs (${[...known].join(", ")})`);
  if (k.kind !== "Kustomization") fail(`${file}: kind must be Kustomization`);
  const objects = [];
  for (const r of k.resources ?? []) {
    const p = path.resolve(dir, r);
    if (!fs.existsSync(p)) fail(`${file}: resource '${r}' does not exist`);
    if (fs.statSync(p).isDirectory()) objects.push(...render(p, [...seen, dir]));
    else objects.push(...loadYamlDocs(p));
  }
  for (const [i, p] of (k.patches ?? []).entries()) {
    const where = `${file}: patches[${i}]`;
    if (!p.target?.kind || !p.target?.name) fail(`${where}: needs target.kind and target.name`);
    const text = p.patch ?? (p.path ? fs.readFileSync(path.resolve(dir, p.path), "utf8") : fail(`${where}: needs patch or path`));
    const ops = yaml.load(text);
    const hits = objects.filter((o) => o.kind === p.target.kind && o.metadata?.name === p.target.name);
    if (hits.length === 0) fail(`${where}: no ${p.target.kind} named ${p.target.name}`);
    for (const o of hits) applyJson6902(o, ops, where);
  }
  if (k.images) for (const o of objects) setImages(o, k.images);
  return objects;
}

// Every directory under `root` that holds a kustomization.yaml.
export function kustomizations(root) {
  const out = [];
  const walk = (d) => {
    if (fs.existsSync(path.join(d, "kustomization.yaml"))) out.push(d);
    for (const e of fs.readdirSync(d, { withFileTypes: true })) if (e.isDirectory() && e.name !== "node_modules") walk(path.join(d, e.name));
  };
  walk(path.resolve(root));
  return out.sort();
}
