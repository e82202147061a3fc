// The coordinator's status page in a real browser (Debian's chromium, driven
// by playwright-core): a coordinator and two nodes of a tiny job, the page
// loaded; both nodes shown training at world size 2; one node killed with
// SIGKILL (its rank dies with it): the page marks it lost and the world
// size drops to 1; a replacement node starts: the page shows it training at
// world size 2 again. A screenshot of that last state goes to SCREENSHOT.
//
// usage: node status_page.mjs DTACTOR_BINARY WORK_DIR SCREENSHOT
// Exit 77 (a skip) without chromium, unless CI=true: then it fails.
import { spawn } from "node:child_process";
import { existsSync, mkdirSync, rmSync, readFileSync } from "node:fs";
import net from "node:net";

const [bin, work, screenshot] = process.argv.slice(2);
const browserPath = process.env.CHROMIUM || "/usr/bin/chromium";
if (!existsSync(browserPath)) {
  console.log(`status_page: no browser at ${browserPath} (apt-get install chromium; scripts/install-deps.sh --test installs it)`);
  process.exit(process.env.CI === "true" ? 1 : 77);
}

let chromium;
try {
  ({ chromium } = await import("playwright-core"));
} catch (e) {
  console.log(`status_page: playwright-core is not installed (cd tests/browser && npm ci; scripts/install-deps.sh --test does it): ${e.message}`);
  process.exit(process.env.CI === "true" ? 1 : 77);
}

const freePort = () =>
  new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });

const procs = [];
function start(args, name) {
  const p = spawn(bin, args, { stdio: ["ignore", "pipe", "pipe"] });
  p.log = "";
  p.stdout.on("data", (d) => (p.log += d));
  p.stderr.on("data", (d) => (p.log += d));
  p.name = name;
  procs.push(p);
  return p;
}
function cleanup() {
  for (const p of procs) if (p.exitCode === null && p.signalCode === null) p.kill("SIGKILL");
}
function fail(message) {
  console.log(`status_page: FAILED: ${message}`);
  for (const p of procs) console.log(`---- ${p.name} ----\n${p.log.slice(-3000)}`);
  cleanup();
  process.exit(1);
}
process.on("uncaughtException", (e) => fail(e.stack || String(e)));

rmSync(work, { recursive: true, force: true });
mkdirSync(work, { recursive: true });
const listenPort = await freePort();
const httpPort = await freePort();
const endpoint = `tcp://127.0.0.1:${listenPort}`;
const tiny = ["model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=2", "train.global_batch_size=32", "train.warmup_steps=5",
  "eval.every_steps=0", "checkpoint.every_steps=200", "train.max_steps=100000000", "cluster.min_nodes=2"].flatMap((s) => ["--set", s]);
start(["--role", "coordinator", "--listen", endpoint, "--run-dir", `${work}/run`, "--metrics-port", String(httpPort), "--metrics-addr", "127.0.0.1", ...tiny],
  "coordinator");
const node = (id) => start(["--role", "node", "--coordinator", endpoint, "--node-id", id, "--nproc-per-node", "1", "--threads-per-rank", "1",
  "--advertise-addr", "127.0.0.1"], `node ${id}`);
node("node-a");
const b = node("node-b");

const browser = await chromium.launch({
  executablePath: browserPath,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update",
    "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
const url = `http://127.0.0.1:${httpPort}/`;
for (let i = 0; ; i++) {
  try {
    await page.goto(url, { timeout: 5000 });
    break;
  } catch (e) {
    if (i > 100) fail(`the page at ${url} never loaded: ${e.message}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

// Waits until the page shows what `check` looks for (run in the page).
async function until(what, check, arg, timeoutMs = 90000) {
  try {
    await page.waitForFunction(check, arg, { timeout: timeoutMs, polling: 250 });
  } catch (e) {
    await page.screenshot({ path: `${work}/failed.png` });
    fail(`the page never showed ${what} (screenshot ${work}/failed.png): ${e.message}`);
  }
  console.log(`status_page: ${what}`);
}
const rowState = ([id, state]) =>
  [...document.querySelectorAll("#members tr")].some((tr) => tr.cells[0]?.textContent === id && tr.cells[3]?.textContent === state);
const world = (n) => document.getElementById("world").textContent === String(n);

await until("both nodes training at world size 2", ([a, b]) => {
  const rows = [...document.querySelectorAll("#members tr")];
  const training = (id) => rows.some((tr) => tr.cells[0]?.textContent === id && tr.cells[3]?.textContent === "training");
  return training(a) && training(b) && document.getElementById("world").textContent === "2" && Number(document.getElementById("step").textContent.split(" ")[0]) > 0;
}, ["node-a", "node-b"]);

b.kill("SIGKILL");
await until("node-b lost", rowState, ["node-b", "lost"]);
await until("world size 1", world, 1);
await until("a recovery listed", () => document.querySelectorAll("#recoveries tr td.empty").length === 0);

node("node-c");
await until("node-c training", rowState, ["node-c", "training"]);
await until("world size 2 again", world, 2);

const json = await page.evaluate(async () => (await fetch("status.json")).json());
if (json.recoveries.total < 1) fail(`status.json counts ${json.recoveries.total} recoveries`);
await page.screenshot({ path: screenshot, fullPage: true });
console.log(`status_page: screenshot ${screenshot}`);
await browser.close();
cleanup();
process.exit(0);
