// Browser step times (training step + optimizer step) in headless Chromium on 1 and 2 WebAssembly threads,
// alternating the variants over rounds; then one WebGPU try. Run make_bench.py first (it writes the models
// and the Python runtime's times on the same threads).
//   node bench/bench.mjs [rounds]
import { readFileSync, writeFileSync } from 'node:fs';
import { launch, openAndWait } from '../browser-test/chromium.js';
import { serve } from '../example/serve.mjs';

const rounds = Number(process.argv[2] ?? 3);
const models = ['mlp', 'transformer'];
const server = await serve(0);
const browser = await launch();
const { port } = server.address();
const median = (v) => v.slice().sort((a, b) => a - b)[Math.floor(v.length / 2)];
const times = {};
async function run(model, threads, ep = 'wasm') {
  const page = await browser.newPage();
  try {
    const url = `http://127.0.0.1:${port}/web/example/?bench=/web/bench/${model}/&threads=${threads}&ep=${ep}`;
    const result = await openAndWait(page, url, 590_000);
    if (result.error) throw new Error(result.error.split('\n')[0]);
    return result.bench.median_ms;
  } finally {
    await page.close();
  }
}
for (let r = 0; r < rounds; r++) {
  for (const threads of [1, 2]) {
    for (const model of models) {
      const key = `${model}/${threads}`;
      (times[key] ??= []).push(await run(model, threads));
      console.log(`round ${r} ${key}: ${times[key].at(-1).toFixed(2)} ms`);
    }
  }
}
const python = JSON.parse(readFileSync(new URL('./python_results.json', import.meta.url)));
const out = { wasm: {}, webgpu: {} };
for (const model of models) {
  for (const threads of [1, 2]) {
    const ms = median(times[`${model}/${threads}`]);
    out.wasm[`${model}/${threads}`] = { browser_ms: ms, python_ms: python[model][threads], ratio: ms / python[model][threads] };
  }
  try {
    out.webgpu[model] = { browser_ms: await run(model, 1, 'webgpu') };
  } catch (error) {
    out.webgpu[model] = { error: String(error.message ?? error).slice(0, 300) };
  }
}
const gpu = await (async () => {
  const page = await browser.newPage();
  await page.goto(`http://127.0.0.1:${port}/web/example/`);
  const info = await page.evaluate(async () => {
    if (!navigator.gpu) return 'navigator.gpu absent';
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) return 'no WebGPU adapter';
    const i = adapter.info ?? {};
    return `adapter: ${i.vendor} ${i.architecture} ${i.description ?? ''}`.trim();
  });
  await page.close();
  return info;
})();
out.webgpu.adapter = gpu;
out.chromium = await browser.version();
console.log(JSON.stringify(out, null, 1));
writeFileSync(new URL('./browser_results.json', import.meta.url), JSON.stringify(out, null, 1));
await browser.close();
server.close();
