// Unknown fields, as the API server's strict field validation (kubectl's
// default since Kubernetes 1.27) refuses them: the JSON schemas that
// kubernetes-models validates with allow any extra property, so a misspelt
// field would pass them silently. The field lists come from the same
// packages' TypeScript declarations (one interface per API type, generated
// from the same OpenAPI documents), read here with a small parser of the
// type forms they use: { "name"?: T; [key: string]: T }, Array<T>, unions,
// literals, and named types imported from other declaration files.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = path.join(here, "node_modules");
const require = createRequire(import.meta.url);

function declarationFile(spec) {
  const f = path.join(modules, spec + ".d.ts");
  return fs.existsSync(f) ? f : null;
}

function tokenize(text) {
  text = text.replace(/\/\*[\s\S]*?\*\//g, " ").replace(/\/\/[^\n]*/g, " ");
  const re = /\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[A-Za-z_$][\w$.]*|-?\d+(?:\.\d+)?|\[\]|[{}()[\]<>;:?|,&=])/gy;
  const toks = [];
  let m;
  while ((m = re.exec(text))) toks.push(m[1]);
  return toks;
}

// Parses one type from toks[i...]; returns [type, next index].
function parseType(toks, i) {
  const members = [];
  if (toks[i] === "|") i++;
  for (;;) {
    let t;
    [t, i] = parsePrimary(toks, i);
    while (toks[i] === "[]") (t = { kind: "array", of: t }), i++;
    members.push(t);
    if (toks[i] === "|" || toks[i] === "&") i++;
    else break;
  }
  return [members.length === 1 ? members[0] : { kind: "union", of: members }, i];
}

function parsePrimary(toks, i) {
  const tok = toks[i];
  if (tok === "{") return parseObject(toks, i);
  if (tok === "(") {
    const [t, j] = parseType(toks, i + 1);
    return [t, j + 1];
  }
  if (tok === "Array" && toks[i + 1] === "<") {
    const [t, j] = parseType(toks, i + 2);
    return [{ kind: "array", of: t }, j + 1];
  }
  if (/^[A-Za-z_$]/.test(tok) && !["string", "number", "boolean", "any", "unknown", "null", "object", "true", "false"].includes(tok))
    return [{ kind: "ref", name: tok }, i + 1];
  return [{ kind: "leaf" }, i + 1];
}

function parseObject(toks, i) {
  const props = new Map();
  let index = null;
  i++; // {
  while (toks[i] !== "}") {
    if (toks[i] === "[") {
      // [key: string]: T
      while (toks[i] !== "]") i++;
      i += 2; // ] :
      [index, i] = parseType(toks, i);
    } else {
      const name = toks[i].replace(/^["']|["']$/g, "");
      i++;
      if (toks[i] === "?") i++;
      if (toks[i] !== ":") throw new Error(`declaration parse error near '${name}'`);
      let t;
      [t, i] = parseType(toks, i + 1);
      props.set(name, t);
    }
    if (toks[i] === ";" || toks[i] === ",") i++;
  }
  return [{ kind: "object", props, index }, i + 1];
}

const fileCache = new Map();

// The main interface of a declaration file, and how its imports resolve.
function loadFile(file) {
  if (fileCache.has(file)) return fileCache.get(file);
  const text = fs.readFileSync(file, "utf8");
  const imports = new Map();
  for (const m of text.matchAll(/import\s*\{([^}]*)\}\s*from\s*"([^"]+)"/g)) {
    const from = m[2].startsWith(".") ? path.resolve(path.dirname(file), m[2]) + ".d.ts" : declarationFile(m[2]);
    for (const n of m[1].split(",")) imports.set(n.trim().split(/\s+as\s+/).pop(), from);
  }
  const entry = { imports, type: null };
  fileCache.set(file, entry);
  const start = text.search(/export interface \w+(?:\s+extends[^{]*)?\s*\{/);
  if (start >= 0) {
    const toks = tokenize(text.slice(text.indexOf("{", start)));
    entry.type = parseObject(toks, 0)[0];
  }
  return entry;
}

function resolveRef(ref, file) {
  const target = loadFile(file).imports.get(ref.name);
  if (!target || !fs.existsSync(target)) return null;
  const t = loadFile(target).type;
  return t ? { type: t, file: target } : null;
}

function check(value, type, file, where, out) {
  if (value === null || value === undefined || !type) return;
  if (type.kind === "ref") {
    const r = resolveRef(type, file);
    if (r) check(value, r.type, r.file, where, out);
  } else if (type.kind === "array") {
    if (Array.isArray(value)) value.forEach((v, i) => check(v, type.of, file, `${where}[${i}]`, out));
  } else if (type.kind === "union") {
    const objects = type.of.filter((t) => t.kind === "object" || t.kind === "ref");
    if (objects.length === 1) check(value, objects[0], file, where, out);
  } else if (type.kind === "object") {
    if (typeof value !== "object" || Array.isArray(value)) return;
    for (const [k, v] of Object.entries(value)) {
      const p = where ? `${where}.${k}` : k;
      if (type.props.has(k)) check(v, type.props.get(k), file, p, out);
      else if (type.index) check(v, type.index, file, p, out);
      else out.push(p);
    }
  }
}

// The unknown fields of a Kubernetes object, as dotted paths; [] when its
// kind's declarations are not found (validate.mjs reports unknown kinds).
export function unknownFields(o) {
  const [group, version] = String(o.apiVersion).includes("/") ? o.apiVersion.split("/") : ["", o.apiVersion];
  const spec = group === "monitoring.coreos.com"
    ? `@kubernetes-models/prometheus-operator/${group}/${version}/${o.kind}`
    : `kubernetes-models/${group ? group + "/" : ""}${version}/${o.kind}`;
  const file = declarationFile(spec);
  if (!file) return [];
  const t = loadFile(file).type;
  if (!t) return [];
  const out = [];
  check(o, t, file, "", out);
  return out;
}
