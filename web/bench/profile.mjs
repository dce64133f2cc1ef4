// Where a bench model's step goes in onnxruntime-web (Node, WebAssembly): the training and the optimizer
// session's `run` timed apart, and, with --ops, onnxruntime's own per-node profile (enableProfiling) as the
// median time of each node over the runs, summed by op type. A Scan node's time includes its body's nodes.
// profile_python.py prints the same for Python onnxruntime's training step.
//   node bench/profile.mjs bench/mlp-web/ [--ops] [--threads N] [--steps N]
import { execFileSync } from 'node:child_process';
import { closeSync, mkdtempSync, openSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import * as ort from 'onnxruntime-web';
import { CheckpointState, Module, Optimizer } from '../lib/index.js';
import { benchFeeds } from './step_time.js';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: { ops: { type: 'boolean' }, threads: { type: 'string', default: '1' }, steps: { type: 'string', default: '15' } },
});
const folder = positionals[0];
const load = (file) => new Uint8Array(readFileSync(join(folder, file)));
ort.env.wasm.numThreads = Number(values.threads);
const options = { sessionOptions: { enableProfiling: !!values.ops } };
const spec = JSON.parse(readFileSync(join(folder, 'bench.json'), 'utf8'));
const state = CheckpointState.fromBytes(load('checkpoint'));
const module = await Module.create(load('training_model.onnx'), state, null, options);
const optimizer = await Optimizer.create(load('optimizer_model.onnx'), module, options);
const feeds = benchFeeds(spec);
const times = { train: [], optimizer: [] };
// Per step: the process's CPU time (all its threads) and the times the kernel took the CPU away from it
// (involuntary context switches). On a shared machine a step's wall time well above its CPU time, with
// about one switch per slow node, means the slow nodes are preemptions, not onnxruntime-web.
const usage = { cpu: [], wall: [], switches: [] };
for (let i = 0; i < Number(values.steps); i++) {
  const cpu0 = process.cpuUsage();
  const switches0 = process.resourceUsage().involuntaryContextSwitches;
  const start = performance.now();
  let t0 = start;
  await module.trainStep(feeds);
  times.train.push(performance.now() - t0);
  t0 = performance.now();
  await optimizer.step();
  module.lazyResetGrad();
  times.optimizer.push(performance.now() - t0);
  const cpu = process.cpuUsage(cpu0);
  usage.cpu.push((cpu.user + cpu.system) / 1000);
  usage.wall.push(performance.now() - start);
  usage.switches.push(process.resourceUsage().involuntaryContextSwitches - switches0);
}
const median = (v) => v.slice().sort((a, b) => a - b)[Math.floor(v.length / 2)];
const skip = (v) => v.slice(Math.min(3, v.length - 1));  // warm-up
console.log(`training step ${median(skip(times.train)).toFixed(2)} ms, optimizer step ${median(skip(times.optimizer)).toFixed(2)} ms ` +
  `(medians, ${values.threads} thread(s))`);
console.log(`a step: wall ${median(skip(usage.wall)).toFixed(2)} ms, CPU ${median(skip(usage.cpu)).toFixed(2)} ms (the process's threads), ` +
  `${median(skip(usage.switches))} involuntary context switches (medians)`);

/** The node events of a profile that onnxruntime-web wrote to stdout (Emscripten's `out`, bound to
 * console.log when the module loaded, so the child process's stdout is where to read it). */
function profileOf(text) {
  const nodes = new Map();
  for (const line of text.split('\n')) {
    const text = line.trim().replace(/,$/, '');
    if (!text.startsWith('{"cat" : "Node"')) continue;
    const event = JSON.parse(text);
    if (!event.name.endsWith('_kernel_time')) continue;
    const key = `${event.args.op_name} ${event.name.replace(/_kernel_time$/, '')}`;
    if (!nodes.has(key)) nodes.set(key, { op: event.args.op_name, shapes: JSON.stringify(event.args.input_type_shape), us: [] });
    nodes.get(key).us.push(event.dur);
  }
  return [...nodes].map(([name, n]) => ({ name, op: n.op, shapes: n.shapes, ms: median(skip(n.us)) / 1000 }));
}

if (values.ops && process.env.ONNXTRAIN_PROFILE_CHILD) {
  module.train_.session.endProfiling();
  console.log('=== optimizer');
  optimizer.session.endProfiling();
} else if (values.ops) {
  // The child's stdout goes to a file: onnxruntime-web writes the profile with blocking-style writes that
  // fail with EAGAIN on a full pipe when the child outruns its reader (seen under `chrt -f`).
  const dir = mkdtempSync(join(tmpdir(), 'onnxtrain-profile-'));
  let child;
  try {
    const fd = openSync(join(dir, 'profile.txt'), 'w');
    try {
      execFileSync(process.execPath, process.argv.slice(1), {
        stdio: ['ignore', fd, 'inherit'], env: { ...process.env, ONNXTRAIN_PROFILE_CHILD: '1' },
      });
    } finally {
      closeSync(fd);
    }
    child = readFileSync(join(dir, 'profile.txt'), 'utf8');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  const [train, opt] = child.split('=== optimizer');
  for (const [what, text] of [['training model', train], ['optimizer model', opt]]) {
    const nodes = profileOf(text).sort((a, b) => b.ms - a.ms);
    const byOp = new Map();
    for (const n of nodes) byOp.set(n.op, (byOp.get(n.op) ?? 0) + n.ms);
    console.log(`\n${what}: ops by time (ms per run, median per node)`);
    for (const [op, ms] of [...byOp].sort((a, b) => b[1] - a[1]).slice(0, 12)) console.log(`  ${op.padEnd(22)} ${ms.toFixed(2)}`);
    const products = ['MatMul', 'FusedMatMul', 'Gemm', 'FusedGemm'];
    console.log(`${what}: matrix products (${products.join(', ')}) ${products.reduce((t, o) => t + (byOp.get(o) ?? 0), 0).toFixed(2)} ms`);
    console.log(`${what}: slowest nodes`);
    for (const n of nodes.slice(0, 10)) console.log(`  ${n.ms.toFixed(2).padStart(8)}  ${n.name.slice(0, 60)} ${n.shapes.slice(0, 90)}`);
  }
}
