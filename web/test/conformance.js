// The conformance loop (docs/format.md, "Conformance fixtures"), shared by the Node tests and the page.
import * as ort from 'onnxruntime-web';
import { CheckpointState, LinearLRScheduler, Module, Optimizer } from '../lib/index.js';

const TYPES = { float32: Float32Array, int64: BigInt64Array };

export function batchFeeds(testCase, index) {
  const batch = testCase.batches[index];
  const feeds = {};
  for (const name of testCase.inputs) {
    const { dtype, shape, data } = batch[name];
    const array = dtype === 'int64' ? BigInt64Array.from(data, (v) => BigInt(v)) : TYPES[dtype].from(data);
    feeds[name] = new ort.Tensor(dtype, array, shape);
  }
  return feeds;
}

/** `load(file)` returns a file of the case's folder as a Uint8Array; `graphs` is '' for the case's own
 * training and optimizer models, 'web/' for its `target="web"` ones (same checkpoint, same numbers).
 * `trainStep`: each step's last call is Optimizer.trainAndStep over web/train_step_model.onnx (one session
 * call where no gradients were accumulated before it). */
export async function runCase(testCase, load, options = {}, graphs = '', trainStep = false) {
  const state = CheckpointState.fromBytes(await load('checkpoint'));
  const module = await Module.create(await load(graphs + 'training_model.onnx'), state, await load('eval_model.onnx'), options);
  const optimizer = await Optimizer.create(await load(graphs + 'optimizer_model.onnx'), module);
  if (trainStep) await optimizer.loadTrainStepModel(await load(graphs + 'train_step_model.onnx'));
  optimizer.setLearningRate(testCase.learning_rate);
  const s = testCase.schedule;
  const scheduler = s ? new LinearLRScheduler(optimizer, s.warmup_step_count, s.total_step_count, s.initial_lr) : null;
  const losses = [];
  let calls = 0;
  for (let step = 0; step < testCase.steps; step++) {
    for (let k = 0; k < testCase.accumulate; k++) {
      const feeds = batchFeeds(testCase, testCase.order[calls++]);
      const last = trainStep && k === testCase.accumulate - 1;
      const outputs = await (last ? optimizer.trainAndStep(feeds) : module.trainStep(feeds));
      losses.push(outputs[module.trainingOutputNames[0]].data[0]);
    }
    if (!trainStep) {
      await optimizer.step();
      module.lazyResetGrad();
    }
    scheduler?.step();
  }
  module.eval();
  const evalOut = await module.evalStep(batchFeeds(testCase, 0));
  return { losses, evalLoss: evalOut[module.evalOutputNames[0]].data[0], state, module };
}

/** Largest difference relative to the largest magnitude of `expected`. */
export function relativeError(ours, expected) {
  let diff = 0;
  let scale = 1e-12;
  for (let i = 0; i < expected.length; i++) {
    diff = Math.max(diff, Math.abs(ours[i] - expected[i]));
    scale = Math.max(scale, Math.abs(expected[i]));
  }
  return diff / scale;
}

/** Compare a trained state with the expected checkpoint: [what, error] of the worst tensor. */
export function worstDifference(state, expected) {
  let worst = ['', 0];
  for (const [name, p] of expected.parameters) {
    const err = relativeError(state.array(name), p.data);
    if (err >= worst[1]) worst = [`parameter ${name}`, err];
  }
  const ours = state.optimizerStates();
  for (const [pname, map] of expected.savedOptimizerStates) {
    for (const [s, data] of map) {
      const err = relativeError(ours.get(pname).get(s), data);
      if (err >= worst[1]) worst = [`${s} of ${pname}`, err];
    }
  }
  return worst;
}
