// WebGPU, tried: headless Chromium (--enable-unsafe-webgpu) replays each conformance fixture with the
// WebGPU execution provider (WebAssembly for the nodes it does not take), once with the case's default
// graphs and once with its target="web" graphs, and compares with the recorded numbers (the fixtures'
// tolerance is 1e-5). Prints the adapter, then per case and graphs: the errors, or why it failed.
//   node bench/webgpu.mjs
import puppeteer from 'puppeteer-core';
import { CHROMIUM } from '../browser-test/chromium.js';
import { serve } from '../example/serve.mjs';

const server = await serve(0);
// A long protocol timeout: on a software adapter one fixture can hold the page for minutes.
const browser = await puppeteer.launch({
  executablePath: CHROMIUM, headless: true, protocolTimeout: 900_000,
  args: ['--no-sandbox', '--disable-dev-shm-usage', '--enable-unsafe-webgpu', '--enable-unsafe-swiftshader'],
});
const { port } = server.address();
const page = await browser.newPage();
await page.goto(`http://127.0.0.1:${port}/web/example/?threads=1`);
const adapter = await page.evaluate(async () => {
  if (!navigator.gpu) return 'navigator.gpu absent';
  const a = await navigator.gpu.requestAdapter();
  if (!a) return 'no WebGPU adapter';
  const i = a.info ?? {};
  return `${i.vendor} ${i.architecture} ${i.description ?? ''}`.trim();
});
console.log(`WebGPU adapter: ${adapter}; ${await browser.version()}`);
for (const name of ['mlp', 'cnn', 'transformer']) {
  for (const graphs of ['', 'web/']) {
    const line = await page.evaluate(async (name, graphs) => {
      const { CheckpointState } = await import('/web/lib/index.js');
      const { runCase, worstDifference } = await import('/web/test/conformance.js');
      const base = `/tests/conformance/${name}/`;
      const load = async (f) => new Uint8Array(await (await fetch(base + f)).arrayBuffer());
      const testCase = await (await fetch(base + 'case.json')).json();
      try {
        const run = await runCase(testCase, load, { executionProviders: ['webgpu', 'wasm'] }, graphs);
        const lossError = Math.max(...run.losses.map((l, i) => Math.abs(l - testCase.losses[i]) / Math.abs(testCase.losses[i])));
        const [worst, err] = worstDifference(run.state, CheckpointState.fromBytes(await load('expected_checkpoint')));
        return `ran ${run.losses.length} training steps: max loss error ${lossError.toExponential(1)}, worst ${worst} ${err.toExponential(1)}`;
      } catch (error) {
        return `failed: ${String(error.message ?? error).split('\n')[0].slice(0, 240)}`;
      }
    }, name, graphs);
    console.log(`${name} (${graphs ? 'web' : 'default'} graphs): ${line}`);
  }
}
await browser.close();
server.close();
