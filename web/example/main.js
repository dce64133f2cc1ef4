// The example page: trains a classifier in the browser with onnxtrain-web, drawing the loss as it goes.
// URL parameters: steps (default 150), threads (WebAssembly threads; default 2 when the page is
// cross-origin isolated, else 1), ep=webgpu, autorun=1 (train at once), conformance=1 (first replay the
// conformance fixtures and compare with the Python runtime; graphs=web replays their target="web" graphs),
// bench=<folder> (time a bench model only).
// Results go to window.onnxtrainResult for the headless test.
import * as ort from 'onnxruntime-web';
import { CheckpointState, LinearLRScheduler, Module, Optimizer } from '../lib/index.js';
import { runCase, worstDifference } from '../test/conformance.js';
import { random, stepTime } from '../bench/step_time.js';

const params = new URLSearchParams(location.search);
const STEPS = Number(params.get('steps') ?? 150);
const BATCH = 32;
const threads = Number(params.get('threads') ?? (self.crossOriginIsolated ? 2 : 1));
ort.env.wasm.numThreads = threads;
const ep = params.get('ep') ?? 'wasm';
const graphs = params.get('graphs') === 'web' ? 'web/' : '';  // the fixtures' target="web" graphs
const options = { executionProviders: ep === 'webgpu' ? ['webgpu', 'wasm'] : ['wasm'] };
const result = { done: false, error: null, threads, ep, crossOriginIsolated: self.crossOriginIsolated };
window.onnxtrainResult = result;
const $ = (id) => document.getElementById(id);
const bytes = async (url) => new Uint8Array(await (await fetch(url)).arrayBuffer());

// Synthetic data: three Gaussian clusters in the plane, from a seeded generator (bench/step_time.js).
function clusters(n, rand) {
  const x = new Float32Array(n * 2);
  const y = new BigInt64Array(n);
  for (let i = 0; i < n; i++) {
    const c = Math.floor(rand() * 3);
    const angle = (2 * Math.PI * c) / 3;
    const gauss = () => Math.sqrt(-2 * Math.log(1 - rand())) * Math.cos(2 * Math.PI * rand());
    x[2 * i] = 1.2 * Math.cos(angle) + 0.55 * gauss();
    x[2 * i + 1] = 1.2 * Math.sin(angle) + 0.55 * gauss();
    y[i] = BigInt(c);
  }
  return { x, y, n };
}

function batch(data, rand, size) {
  const x = new Float32Array(size * 2);
  const y = new BigInt64Array(size);
  for (let i = 0; i < size; i++) {
    const j = Math.floor(rand() * data.n);
    x.set(data.x.subarray(2 * j, 2 * j + 2), 2 * i);
    y[i] = data.y[j];
  }
  return { x: new ort.Tensor('float32', x, [size, 2]), labels: new ort.Tensor('int64', y, [size]) };
}

function drawLoss(losses) {
  const canvas = $('loss');
  const g = canvas.getContext('2d');
  g.clearRect(0, 0, canvas.width, canvas.height);
  g.strokeStyle = '#ddd';
  g.strokeRect(40.5, 10.5, canvas.width - 50, canvas.height - 40);
  const top = Math.max(...losses, 1e-3);
  g.fillStyle = '#555';
  g.fillText(top.toFixed(2), 4, 16);
  g.fillText('0', 28, canvas.height - 30);
  g.fillText(`step ${losses.length}`, canvas.width - 70, canvas.height - 12);
  g.strokeStyle = '#1565c0';
  g.lineWidth = 2;
  g.beginPath();
  losses.forEach((l, i) => {
    const px = 40 + ((canvas.width - 50) * i) / Math.max(1, STEPS - 1);
    const py = 10 + (canvas.height - 40) * (1 - l / top);
    if (i === 0) g.moveTo(px, py);
    else g.lineTo(px, py);
  });
  g.stroke();
}

function drawPoints(data, predicted) {
  const canvas = $('points');
  const g = canvas.getContext('2d');
  const colors = ['#e53935', '#43a047', '#1e88e5'];
  g.clearRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < data.n; i++) {
    g.fillStyle = colors[predicted ? predicted[i] : Number(data.y[i])];
    g.beginPath();
    g.arc(120 + 40 * data.x[2 * i], 120 - 40 * data.x[2 * i + 1], 2.5, 0, 2 * Math.PI);
    g.fill();
  }
}

async function accuracy(module, test) {
  module.eval();
  const out = await module.evalStep({ x: new ort.Tensor('float32', test.x, [test.n, 2]), labels: new ort.Tensor('int64', test.y, [test.n]) });
  module.train();
  const logits = out.logits.data;
  const predicted = [];
  let right = 0;
  for (let i = 0; i < test.n; i++) {
    const row = logits.subarray(3 * i, 3 * i + 3);
    const k = row.indexOf(Math.max(...row));
    predicted.push(k);
    right += k === Number(test.y[i]);
  }
  return { accuracy: right / test.n, predicted };
}

async function conformance() {
  const out = {};
  for (const name of ['mlp', 'cnn', 'transformer']) {
    const base = `/tests/conformance/${name}/`;
    const testCase = await (await fetch(base + 'case.json')).json();
    const run = await runCase(testCase, (file) => bytes(base + file), options, graphs);
    const lossError = Math.max(...run.losses.map((l, i) => Math.abs(l - testCase.losses[i]) / Math.abs(testCase.losses[i])));
    const [worst, paramError] = worstDifference(run.state, CheckpointState.fromBytes(await bytes(base + 'expected_checkpoint')));
    out[name] = { lossError, paramError, worst, steps: testCase.steps };
  }
  return out;
}

async function train() {
  $('train').disabled = true;
  const state = await CheckpointState.loadCheckpoint('./artifacts/checkpoint');
  const module = await Module.create('./artifacts/training_model.onnx', state, './artifacts/eval_model.onnx', options);
  const optimizer = await Optimizer.create('./artifacts/optimizer_model.onnx', module);
  const scheduler = new LinearLRScheduler(optimizer, 10, STEPS, 2e-2);
  const rand = random(7);
  const trainSet = clusters(600, rand);
  const testSet = clusters(300, rand);
  const losses = [];
  drawPoints(testSet, null);
  const start = performance.now();
  for (let step = 0; step < STEPS; step++) {
    const feeds = batch(trainSet, rand, BATCH);
    const out = await module.trainStep(feeds);
    await optimizer.step();
    module.lazyResetGrad();
    scheduler.step();
    losses.push(out.loss.data[0]);
    if (step % 10 === 9 || step === STEPS - 1) {
      const { accuracy: acc, predicted } = await accuracy(module, testSet);
      result.accuracy = acc;
      drawLoss(losses);
      drawPoints(testSet, predicted);
      $('step').textContent = step + 1;
      $('lossValue').textContent = losses[step].toFixed(4);
      $('accuracy').textContent = `${(100 * acc).toFixed(1)}%`;
      $('stepTime').textContent = `${((performance.now() - start) / (step + 1)).toFixed(2)} ms`;
      await new Promise((r) => setTimeout(r, 0)); // let the page paint
    }
  }
  result.losses = losses;
  result.chartPoints = losses.length;
  state.properties.steps = STEPS;
  const saved = CheckpointState.saveCheckpoint(state, true);
  result.savedBytes = saved.length;
  result.reloaded = CheckpointState.fromBytes(saved).optimizerStep;
  $('save').disabled = false;
  $('save').onclick = () => {
    const link = document.createElement('a');
    link.href = URL.createObjectURL(new Blob([saved], { type: 'application/octet-stream' }));
    link.download = 'checkpoint';
    link.click();
  };
}

async function main() {
  $('backend').textContent = `${ep}, ${threads} thread${threads > 1 ? 's' : ''}${self.crossOriginIsolated ? ' (cross-origin isolated)' : ''}`;
  try {
    if (params.get('bench')) {
      const folder = params.get('bench');
      result.bench = await stepTime((file) => bytes(folder + file), { ...options, trainStep: params.get('trainStep') !== '0' });
    } else {
      if (params.get('conformance')) {
        $('status').textContent = 'replaying the conformance fixtures…';
        result.conformance = await conformance();
      }
      $('status').textContent = 'training…';
      await train();
    }
    $('status').textContent = 'done';
  } catch (error) {
    result.error = String(error?.stack ?? error);
    $('status').textContent = `error: ${error.message ?? error}`;
  }
  result.done = true;
}

$('train').onclick = () => main();
$('status').textContent = 'ready';
if (params.get('autorun') || params.get('bench') || params.get('conformance')) main();
