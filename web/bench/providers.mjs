// Which CPU paths faster than onnxruntime-web's WebAssembly kernels exist here (issue 19): prints one line
// per check, each with the error message or the result that decides it.
//   node bench/providers.mjs            (about 2 minutes of CPU time; needs Chromium for the WebNN part)
//
// 1. Execution providers built into each WebAssembly build of the installed onnxruntime-web. Its JavaScript
//    accepts only 'wasm'/'cpu', 'webgpu' and 'webnn', so each build is loaded from a patched copy of the
//    Node bundle (in a temporary folder, removed afterwards) that hands the C API's provider names
//    (XNNPACK, WEBNN) to `OrtAppendExecutionProvider` unchanged: the build itself answers.
// 2. Relaxed SIMD: a build compiled with relaxed-SIMD instructions does not validate in a V8 with relaxed
//    SIMD turned off; each build is validated there (after checking that a one-instruction relaxed-SIMD
//    module is refused, so the check can fail).
// 3. WebNN in Chromium (Debian's package, flag WebMachineLearningNeuralNetwork): `navigator.ml`, and
//    `createContext` for each device type.
import { execFileSync } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

const WEB = fileURLToPath(new URL('..', import.meta.url));
const DIST = join(WEB, 'node_modules/onnxruntime-web/dist');
const VERSION = JSON.parse(readFileSync(join(DIST, '../package.json'), 'utf8')).version;
const BUILDS = ['', '.jsep', '.asyncify'];  // the JSPI build needs WebAssembly.Suspending (not in Node 20)
const PROVIDERS = ['XNNPACK', 'WEBNN'];  // 'JS' is the WebGPU provider (bench/webgpu.mjs)
const MODEL = join(WEB, '../tests/conformance/mlp/eval_model.onnx');

function patchedBundle(folder, build) {
  let text = readFileSync(join(DIST, 'ort.node.min.mjs'), 'utf8');
  const edits = [
    // load this build's module
    [/ort-wasm-simd-threaded\.mjs/g, `ort-wasm-simd-threaded${build}.mjs`],
    // register the WebAssembly backend under the C API's names too, so onnxruntime-common keeps them
    [/(\w+)\("wasm",(\w+),10\)/, (m, reg, backend) => `${m},${PROVIDERS.map((p) => `${reg}("${p}",${backend},10)`).join(',')}`],
    // pass an unknown provider name on instead of refusing it in JavaScript
    [/default:throw new Error\(`not supported execution provider: \$\{\w+\}`\)/, 'default:break'],
  ];
  for (const [pattern, replacement] of edits) {
    const next = text.replace(pattern, replacement);
    if (next === text && !(build === '' && String(pattern).includes('threaded'))) throw new Error(`onnxruntime-web ${VERSION}: its Node bundle changed; cannot patch ${pattern}`);
    text = next;
  }
  writeFileSync(join(folder, 'ort.mjs'), text);
  for (const ext of ['mjs', 'wasm']) copyFileSync(join(DIST, `ort-wasm-simd-threaded${build}.${ext}`), join(folder, `ort-wasm-simd-threaded${build}.${ext}`));
  mkdirSync(join(folder, 'node_modules'));
  symlinkSync(join(WEB, 'node_modules/onnxruntime-common'), join(folder, 'node_modules/onnxruntime-common'));
  writeFileSync(join(folder, 'try.mjs'), `
import * as ort from './ort.mjs';
import { readFileSync } from 'node:fs';
ort.env.wasm.numThreads = 1;
const bytes = readFileSync(${JSON.stringify(MODEL)});
const out = {};
for (const ep of ${JSON.stringify(PROVIDERS)}) {
  try {
    const session = await ort.InferenceSession.create(bytes, { executionProviders: [ep, 'wasm'] });
    out[ep] = 'session created';
    await session.release();
  } catch (error) { out[ep] = String(error.message ?? error).replace(/^.*ERROR_MESSAGE: /, '').replace(/\\/mnt\\/\\S+\\//, '').trim(); }
}
console.log(JSON.stringify(out));`);
}

const lines = [`onnxruntime-web ${VERSION}`];
for (const build of BUILDS) {
  const folder = mkdtempSync(join(tmpdir(), 'onnxtrain-providers-'));
  try {
    patchedBundle(folder, build);
    const out = execFileSync(process.execPath, [join(folder, 'try.mjs')], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] });
    const answers = JSON.parse(out.trim().split('\n').at(-1));
    for (const [ep, answer] of Object.entries(answers)) lines.push(`provider ${ep} in ort-wasm-simd-threaded${build}.wasm: ${answer.split('\n')[0].slice(0, 160)}`);
  } finally {
    rmSync(folder, { recursive: true, force: true });
  }
}

// i32x4.relaxed_trunc_f32x4_s (0xfd 0x101) in a function (v128) -> v128
const RELAXED = [0, 97, 115, 109, 1, 0, 0, 0, 1, 6, 1, 96, 1, 123, 1, 123, 3, 2, 1, 0, 10, 9, 1, 7, 0, 32, 0, 0xfd, 0x81, 0x02, 11];
const validate = `
const { readFileSync } = await import('node:fs');
const out = { probe: WebAssembly.validate(new Uint8Array(${JSON.stringify(RELAXED)})) };
for (const f of ${JSON.stringify(BUILDS.map((b) => join(DIST, `ort-wasm-simd-threaded${b}.wasm`)))}) out[f.split('/').pop()] = WebAssembly.validate(readFileSync(f));
console.log(JSON.stringify(out));`;
try {
  const out = JSON.parse(execFileSync(process.execPath, ['--no-experimental-wasm-relaxed-simd', '--input-type=module', '-e', validate], { encoding: 'utf8' }));
  if (out.probe) {
    lines.push('relaxed SIMD: not checked (this V8 accepts relaxed-SIMD instructions even with the flag off)');
  } else {
    for (const [file, ok] of Object.entries(out)) {
      if (file !== 'probe') lines.push(`relaxed SIMD in ${file}: ${ok ? 'none (validates with relaxed SIMD off)' : 'present or another feature missing (does not validate with relaxed SIMD off)'}`);
    }
  }
} catch (error) {
  lines.push(`relaxed SIMD: not checked (${error.message.split('\n')[0]})`);
}

try {
  const { launch } = await import('../browser-test/chromium.js');
  const { serve } = await import('../example/serve.mjs');
  const server = await serve(0);
  const browser = await launch(['--enable-features=WebMachineLearningNeuralNetwork']);
  try {
    const page = await browser.newPage();
    await page.goto(`http://127.0.0.1:${server.address().port}/web/package.json`);
    const answers = await page.evaluate(async () => {
      if (!navigator.ml) return { 'navigator.ml': 'absent' };
      const out = {};
      for (const deviceType of ['cpu', 'gpu', 'npu']) {
        try {
          await navigator.ml.createContext({ deviceType });
          out[deviceType] = 'context created';
        } catch (error) { out[deviceType] = String(error.message ?? error); }
      }
      return out;
    });
    const version = await browser.version();
    for (const [device, answer] of Object.entries(answers)) lines.push(`WebNN ${device} in ${version}: ${answer}`);
  } finally {
    await browser.close();
    server.close();
  }
} catch (error) {
  lines.push(`WebNN: not checked (${error.message.split('\n')[0]})`);
}
console.log(lines.join('\n'));
