// The benchmark's step: a training step, an optimizer step and a gradient reset, timed over the bench
// model's `bench.json` (warm-up steps, then timed steps; the median). Shared by the page (?bench=) and Node
// (bench/node_step.mjs), so both time the same loop.
import * as ort from 'onnxruntime-web';
import { CheckpointState, Module, Optimizer } from '../lib/index.js';

/** A small seeded generator: the page's synthetic data and the bench's batch. */
export function random(seed) {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = Math.imul(s ^ (s >>> 15), 1 | s);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** The bench's batch for `bench.json`'s inputs: seeded, the same in the page, in Node and in profile.mjs. */
export function benchFeeds(spec) {
  const rand = random(1);
  const feeds = {};
  for (const { name, dtype, shape, high } of spec.inputs) {
    const n = shape.reduce((a, b) => a * b, 1);
    feeds[name] = dtype === 'int64'
      ? new ort.Tensor('int64', BigInt64Array.from({ length: n }, () => BigInt(Math.floor(rand() * high))), shape)
      : new ort.Tensor('float32', Float32Array.from({ length: n }, () => rand() * 2 - 1), shape);
  }
  return feeds;
}

/** `load(file)` returns a file of the bench folder as a Uint8Array; `options` go to Module.create. */
export async function stepTime(load, options = {}) {
  const spec = JSON.parse(new TextDecoder().decode(await load('bench.json')));
  const state = CheckpointState.fromBytes(await load('checkpoint'));
  const module = await Module.create(await load('training_model.onnx'), state, null, options);
  const optimizer = await Optimizer.create(await load('optimizer_model.onnx'), module);
  // Web artifacts' train-step model (one session call a step), unless options.trainStep === false.
  const trainStep = spec.train_step && options.trainStep !== false;
  if (trainStep) await optimizer.loadTrainStepModel(await load('train_step_model.onnx'));
  const feeds = benchFeeds(spec);
  const times = [];
  for (let i = 0; i < spec.warmup + spec.steps; i++) {
    const t0 = performance.now();
    await optimizer.trainAndStep(feeds);  // with the train-step model: one call; else trainStep, step, reset
    if (i >= spec.warmup) times.push(performance.now() - t0);
  }
  times.sort((a, b) => a - b);
  return { median_ms: times[Math.floor(times.length / 2)], steps: times.length, trainStep };
}
