// node --test: onnxtrain-web reproduces the conformance fixtures written by the Python runtime, and refuses
// bad checkpoints and inputs with errors that name the problem.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import * as ort from 'onnxruntime-web';
import { CheckpointState, Module, OnnxtrainError, Optimizer } from '../lib/index.js';
import { batchFeeds, relativeError, runCase, worstDifference } from './conformance.js';

ort.env.wasm.numThreads = 1;
const FIXTURES = new URL('../../tests/conformance/', import.meta.url);
const RTOL = 1e-5;
const file = (name, rel) => new Uint8Array(readFileSync(new URL(`${name}/${rel}`, FIXTURES)));
const caseOf = (name) => JSON.parse(readFileSync(new URL(`${name}/case.json`, FIXTURES), 'utf8'));

const VARIANTS = [['', false], ['web/', false], ['web/', true]];  // graphs, train-step model
for (const [name, graphs, trainStep] of ['mlp', 'cnn', 'transformer'].flatMap((n) => VARIANTS.map((v) => [n, ...v]))) {
  const what = trainStep ? `${name} (web artifacts, trainAndStep)` : graphs ? `${name} (web artifacts)` : name;
  test(`${what}: losses and parameters after ${caseOf(name).steps} steps match the Python runtime`, async (t) => {
    const testCase = caseOf(name);
    const { losses, evalLoss, state } = await runCase(testCase, (rel) => file(name, rel), {}, graphs, trainStep);
    assert.equal(losses.length, testCase.losses.length);
    const lossErr = Math.max(...losses.map((l, i) => Math.abs(l - testCase.losses[i]) / Math.abs(testCase.losses[i])));
    assert.ok(lossErr <= RTOL, `loss relative error ${lossErr}`);
    assert.ok(Math.abs(evalLoss - testCase.eval_loss) <= RTOL * Math.abs(testCase.eval_loss), `eval loss ${evalLoss}`);
    const expected = CheckpointState.fromBytes(file(name, 'expected_checkpoint'));
    const [what, err] = worstDifference(state, expected);
    assert.ok(err <= RTOL, `${what}: relative error ${err}`);
    t.diagnostic(`${what}: max loss error ${lossErr.toExponential(1)}, worst tensor ${what} ${err.toExponential(1)}`);
    assert.equal(state.optimizerStep, testCase.steps);
    // save, load and compare: the bytes round-trip through the checkpoint format
    const again = CheckpointState.fromBytes(CheckpointState.saveCheckpoint(state, true));
    assert.deepEqual(worstDifference(again, expected)[1] <= RTOL, true);
    assert.equal(again.optimizerStep, testCase.steps);
  });
}

test('a checkpoint written here loads in the same layout the Python runtime writes', () => {
  const bytes = file('mlp', 'checkpoint');
  const state = CheckpointState.fromBytes(bytes);
  state.properties.epoch = 3;
  state.properties.note = 'hello';
  state.properties.ratio = 0.25;
  const again = CheckpointState.fromBytes(CheckpointState.saveCheckpoint(state));
  assert.deepEqual(again.properties, { epoch: 3, note: 'hello', ratio: 0.25 });
  for (const [n, p] of state.parameters) assert.equal(relativeError(again.array(n), p.data), 0);
});

test('bad checkpoints are refused with a reason', () => {
  const model = file('mlp', 'training_model.onnx');
  assert.throws(() => CheckpointState.fromBytes(model), /not an onnxtrain checkpoint/);
  assert.throws(() => CheckpointState.fromBytes(new Uint8Array(0)), /empty/);
  const bytes = file('mlp', 'checkpoint');
  assert.throws(() => CheckpointState.fromBytes(bytes.subarray(0, bytes.length - 10)), /truncated/);
  const damaged = bytes.slice();
  damaged[damaged.length - 3] ^= 0xff;
  assert.throws(() => CheckpointState.fromBytes(damaged), /damaged: the checksum of parameter/);
});

test('a checkpoint of other artifacts is refused by name', async () => {
  const state = CheckpointState.fromBytes(file('cnn', 'checkpoint'));
  await assert.rejects(Module.create(file('mlp', 'training_model.onnx'), state),
    (e) => e instanceof OnnxtrainError && /the checkpoint lacks parameters \[net\.0\.weight/.test(e.message));
  const mlp = CheckpointState.fromBytes(file('mlp', 'checkpoint'));
  mlp.parameters.set('head.weight', { dtype: 'float32', shape: [2], data: new Float32Array(2), requiresGrad: true });
  await assert.rejects(Module.create(file('mlp', 'training_model.onnx'), mlp), /has parameters \[head\.weight\] that the training model does not use/);
  await assert.rejects(Module.create(file('mlp', 'eval_model.onnx'), CheckpointState.fromBytes(file('mlp', 'checkpoint'))), /this is the eval model/);
  await assert.rejects(Module.create(file('mlp', 'checkpoint'), CheckpointState.fromBytes(file('mlp', 'checkpoint'))), /not an onnxtrain training model/);
});

test('missing inputs, shape mismatches and out-of-range labels are refused by name', async () => {
  const testCase = caseOf('mlp');
  const state = CheckpointState.fromBytes(file('mlp', 'checkpoint'));
  const module = await Module.create(file('mlp', 'training_model.onnx'), state, file('mlp', 'eval_model.onnx'));
  const feeds = batchFeeds(testCase, 0);
  await assert.rejects(module.trainStep({ x: feeds.x }), /missing input "labels"/);
  await assert.rejects(module.trainStep([feeds.x]), /the model takes 2 inputs/);
  const fewer = new ort.Tensor('int64', feeds.labels.data.slice(0, 7), [7]);
  await assert.rejects(module.trainStep({ x: feeds.x, labels: fewer }), /input "labels" has 7 on axis 0 but input "x" has 8 on axis 0/);
  const narrow = new ort.Tensor('float32', new Float32Array(8 * 15), [8, 15]);
  await assert.rejects(module.trainStep({ x: narrow, labels: feeds.labels }), /input "x" must have size 16 on axis 1/);
  const bad = feeds.labels.data.slice();
  bad[3] = 5n;
  await assert.rejects(module.trainStep({ x: feeds.x, labels: new ort.Tensor('int64', bad, [8]) }),
    /input "labels" has value 5 at \[3\], out of range: class labels of CrossEntropyLoss \(5 classes\) must lie in \[0, 5\)/);
  const floats = new ort.Tensor('float32', new Float32Array(8), [8]);
  await assert.rejects(module.trainStep({ x: feeds.x, labels: floats }), /input "labels" must be int64, got float32/);
});

test('token ids outside the embedding table are refused by name', async () => {
  const testCase = caseOf('transformer');
  const state = CheckpointState.fromBytes(file('transformer', 'checkpoint'));
  const module = await Module.create(file('transformer', 'training_model.onnx'), state);
  const feeds = batchFeeds(testCase, 0);
  const ids = feeds.ids.data.slice();
  ids[5] = 24n;
  await assert.rejects(module.trainStep({ ids: new ort.Tensor('int64', ids, feeds.ids.dims), labels: feeds.labels }),
    /input "ids" has value 24 at \[0, 5\], out of range: indices into 'tok.weight' \(24 rows, Gather\)/);
});

test('an optimizer model of other artifacts is refused', async () => {
  const state = CheckpointState.fromBytes(file('mlp', 'checkpoint'));
  const module = await Module.create(file('mlp', 'training_model.onnx'), state);
  await assert.rejects(Optimizer.create(file('cnn', 'optimizer_model.onnx'), module), /use the optimizer model generated with this training model/);
});

test('contiguous parameters out and in; gradient accumulation adds', async () => {
  const testCase = caseOf('mlp');
  const state = CheckpointState.fromBytes(file('mlp', 'checkpoint'));
  const module = await Module.create(file('mlp', 'training_model.onnx'), state, file('mlp', 'eval_model.onnx'));
  const flat = module.getContiguousParameters();
  assert.equal(flat.dims[0], module.getParametersSize(false));
  module.loadParametersBuffer(new Float32Array(flat.data.length));
  module.eval();
  const out = await module.evalStep(batchFeeds(testCase, 0));
  assert.ok(Math.abs(out.loss.data[0] - Math.log(5)) < 1e-6); // all-zero logits
  module.loadParametersBuffer(flat);
  assert.throws(() => module.loadParametersBuffer(new Float32Array(3)), /the buffer has 3 elements/);
  module.train();
  await module.trainStep(batchFeeds(testCase, 0));
  const once = Float32Array.from(state.buffers.grads.get('float32'));
  await module.trainStep(batchFeeds(testCase, 0));
  const twice = state.buffers.grads.get('float32');
  assert.ok(relativeError(twice, once.map((g) => 2 * g)) < 1e-6);
  module.lazyResetGrad();
  await module.trainStep(batchFeeds(testCase, 0));
  assert.ok(relativeError(state.buffers.grads.get('float32'), once) < 1e-7);
});

test('a training model of a later format (fp16 with loss scaling) is refused, not trained wrongly', async () => {
  // Same-length edit of the metadata JSON inside the protobuf: format 2 -> 3.
  const bytes = file('mlp', 'training_model.onnx');
  const text = Buffer.from(bytes).toString('latin1');
  const at = text.indexOf('"format": 2');
  assert.ok(at > 0);
  const later = new Uint8Array(bytes);
  later[at + '"format": '.length] = '3'.charCodeAt(0);
  const state = CheckpointState.fromBytes(file('mlp', 'checkpoint'));
  await assert.rejects(Module.create(later, state), (e) => e instanceof OnnxtrainError && /has format 3; onnxtrain-web trains format 2/.test(e.message));
});

test('trainAndStep runs the train-step model alone, and only where no gradients were accumulated', async () => {
  const testCase = caseOf('mlp');
  const open = async () => {
    const state = CheckpointState.fromBytes(file('mlp', 'checkpoint'));
    const module = await Module.create(file('mlp', 'web/training_model.onnx'), state);
    const optimizer = await Optimizer.create(file('mlp', 'web/optimizer_model.onnx'), module);
    return { state, module, optimizer };
  };
  const fused = await open();
  await fused.optimizer.loadTrainStepModel(file('mlp', 'web/train_step_model.onnx'));
  const calls = { trainingModel: 0, optimizerModel: 0 };
  for (const [key, session] of [['trainingModel', fused.module.train_.session], ['optimizerModel', fused.optimizer.session]]) {
    const run = session.run.bind(session);
    session.run = (...args) => { calls[key]++; return run(...args); };
  }
  const plain = await open();
  for (let i = 0; i < 3; i++) {
    const ours = await fused.optimizer.trainAndStep(batchFeeds(testCase, i));
    const theirs = await plain.module.trainStep(batchFeeds(testCase, i));
    await plain.optimizer.step();
    plain.module.lazyResetGrad();
    assert.ok(Math.abs(ours.loss.data[0] - theirs.loss.data[0]) <= 1e-6 * Math.abs(theirs.loss.data[0]));
  }
  assert.deepEqual(calls, { trainingModel: 0, optimizerModel: 0 });  // one session call a step
  assert.equal(fused.state.optimizerStep, 3);
  assert.ok(relativeError(fused.module.getContiguousParameters().data, plain.module.getContiguousParameters().data) < 1e-6);
  // accumulated gradients: the two models run, the accumulated ones count
  await fused.module.trainStep(batchFeeds(testCase, 3));
  await fused.optimizer.trainAndStep(batchFeeds(testCase, 0));
  await plain.module.trainStep(batchFeeds(testCase, 3));
  await plain.module.trainStep(batchFeeds(testCase, 0));
  await plain.optimizer.step();
  plain.module.lazyResetGrad();
  assert.deepEqual(calls, { trainingModel: 2, optimizerModel: 1 });
  assert.ok(relativeError(fused.module.getContiguousParameters().data, plain.module.getContiguousParameters().data) < 1e-6);
});

test('a train-step model of other artifacts, or another model, is refused', async () => {
  const state = CheckpointState.fromBytes(file('mlp', 'checkpoint'));
  const module = await Module.create(file('mlp', 'web/training_model.onnx'), state);
  const optimizer = await Optimizer.create(file('mlp', 'web/optimizer_model.onnx'), module);
  await assert.rejects(optimizer.loadTrainStepModel(file('cnn', 'web/train_step_model.onnx')),
    (e) => e instanceof OnnxtrainError && /comes from other artifacts/.test(e.message));
  await assert.rejects(optimizer.loadTrainStepModel(file('mlp', 'web/training_model.onnx')),
    (e) => e instanceof OnnxtrainError && /this is the training model; pass train_step_model.onnx/.test(e.message));
});
