// Step times (training step + optimizer step + gradient reset) of onnxtrain-web in headless Chromium and in
// Node (the same WebAssembly), on 1 and 2 threads, against the Python runtime's times that make_bench.py
// wrote; the variants alternate over rounds and each number is a median. Run make_bench.py first (it writes
// the models and the Python times). WebGPU is tried by bench/webgpu.mjs.
//   node bench/bench.mjs [rounds]        (default 3)
// Targets (issue 19): Chromium on one thread within 2.5x of Python on one thread; two threads faster than
// one. Both are checked on the `target="web"` artifacts (<model>-web/), the ones made for the browser, run
// with their train-step model (one session call a step); the column "web, two calls" runs the same
// artifacts with a training and an optimizer call a step, to show what the train-step model saves.
import { execFileSync } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { launch, openAndWait } from '../browser-test/chromium.js';
import { serve } from '../example/serve.mjs';

const rounds = Number(process.argv[2] ?? 3);
// default artifacts, target="web" artifacts (train-step model), the same with two calls a step
const VARIANTS = [['', ''], ['-web', ''], ['-web', '&trainStep=0']];
const label = ([folder, query]) => folder + (query ? ' two calls' : '');
const THREADS = [1, 2];
const TARGET_RATIO = 2.5;
const HERE = fileURLToPath(new URL('.', import.meta.url));
const python = JSON.parse(readFileSync(new URL('./python_results.json', import.meta.url)));
const MODELS = Object.keys(python);  // the models make_bench.py wrote and timed

const server = await serve(0);
const browser = await launch();
const { port } = server.address();
const median = (v) => v.slice().sort((a, b) => a - b)[Math.floor(v.length / 2)];

async function chromium(folder, threads, query = '') {
  const page = await browser.newPage();
  try {
    const url = `http://127.0.0.1:${port}/web/example/?bench=/web/bench/${folder}/&threads=${threads}${query}`;
    const result = await openAndWait(page, url, 590_000);
    if (result.error) throw new Error(result.error.split('\n')[0]);
    if (threads > 1 && !result.crossOriginIsolated) throw new Error('the page is not cross-origin isolated');
    const oneCall = folder.endsWith('-web') && !query;
    if (result.bench.trainStep !== oneCall) throw new Error(`${folder}${query}: train-step model ${result.bench.trainStep ? 'used' : 'not used'}`);
    return result.bench.median_ms;
  } finally {
    await page.close();
  }
}

function node(folder, threads) {
  const out = execFileSync(process.execPath, [HERE + 'node_step.mjs', HERE + folder, String(threads)], { encoding: 'utf8' });
  return JSON.parse(out.trim().split('\n').at(-1)).median_ms;
}

const times = {};
const record = (key, ms) => {
  (times[key] ??= []).push(ms);
  console.log(`${key}: ${ms.toFixed(2)} ms`);
};
const t0 = performance.now();
for (let r = 0; r < rounds; r++) {
  console.log(`round ${r + 1} of ${rounds}`);
  for (const threads of THREADS) {
    for (const model of MODELS) {
      for (const v of VARIANTS) record(`chromium ${model}${label(v)} ${threads}`, await chromium(model + v[0], threads, v[1]));
      record(`node ${model}-web ${threads}`, node(model + '-web', threads));
    }
  }
}

const rows = [];
const out = { rounds, wasm: {}, targets: {} };
for (const model of MODELS) {
  for (const threads of THREADS) {
    const m = (key) => median(times[key]);
    const row = {
      model, threads,
      chromium_default_ms: m(`chromium ${model} ${threads}`),
      chromium_web_ms: m(`chromium ${model}-web ${threads}`),
      chromium_web_two_calls_ms: m(`chromium ${model}-web two calls ${threads}`),
      node_web_ms: m(`node ${model}-web ${threads}`),
      python_ms: python[model][threads],
    };
    row.ratio = row.chromium_web_ms / row.python_ms;
    rows.push(row);
    out.wasm[`${model}/${threads}`] = row;
  }
  const [one, two] = rows.filter((r) => r.model === model);
  out.targets[`${model}: Chromium 1 thread within ${TARGET_RATIO}x of Python`] = one.ratio <= TARGET_RATIO;
  out.targets[`${model}: Chromium 2 threads faster than 1`] = two.chromium_web_ms < one.chromium_web_ms;
}
out.chromium = await browser.version();
out.minutes = (performance.now() - t0) / 60_000;
await browser.close();
server.close();

const f = (x) => x.toFixed(1);
console.log(`\n| model | threads | Chromium, default artifacts (ms) | Chromium, web artifacts (ms) | Chromium, web, two calls (ms) | Node, web artifacts (ms) | Python (ms) | Chromium web / Python | target |`);
console.log('|---|---|---|---|---|---|---|---|---|');
for (const r of rows) {
  const target = r.threads === 1 ? `<= ${TARGET_RATIO}x: ${r.ratio <= TARGET_RATIO ? 'met' : 'not met'}` : '';
  console.log(`| ${r.model} | ${r.threads} | ${f(r.chromium_default_ms)} | ${f(r.chromium_web_ms)} | ${f(r.chromium_web_two_calls_ms)} | ${f(r.node_web_ms)} | ${f(r.python_ms)} | ${f(r.ratio)}x | ${target} |`);
}
for (const [what, met] of Object.entries(out.targets)) console.log(`${what}: ${met ? 'met' : 'not met'}`);
console.log(`${out.chromium}; ${rounds} rounds in ${f(out.minutes)} minutes`);
writeFileSync(new URL('./browser_results.json', import.meta.url), JSON.stringify(out, null, 1));
