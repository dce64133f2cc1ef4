// Optimizer: runs the optimizer model over a Module's flat buffers, one session call per step. The model
// reads the live parameters and states and returns new ones (`<input>.out`), which become the live copy.
// With web artifacts' train-step model loaded, `trainAndStep` runs a training step and an optimizer step
// in one session call, the gradients staying in WebAssembly memory (docs/web.md, "The train-step model").
import * as ort from 'onnxruntime-web';
import { Module } from './module.js';
import {
  flatName, GRADIENTS, LEARNING_RATE, OnnxtrainError, OPTIMIZER_METADATA_KEY, PARAMS, STEP,
  TRAINING_METADATA_KEY, updatedName,
} from './format.js';
import { createSession, InputChecker, modelBytes, readMetadata } from './session.js';

export function checkLayout(meta, layout) {
  const names = meta.groups.flatMap((g) => g.params.map((p) => p.name));
  if (names.join('\n') !== layout.names.join('\n')) {
    throw new OnnxtrainError(`the optimizer model updates parameters [${names.slice(0, 5)}...] but the module trains ` +
      `[${layout.names.slice(0, 5)}...]; use the optimizer model generated with this training model`);
  }
  for (const group of meta.groups) {
    const [chunks, chunk] = layout.rows(group.dtype);
    if (group.chunks !== chunks || group.chunk !== chunk) {
      throw new OnnxtrainError(`the optimizer model lays the ${group.dtype} parameters out in chunks ` +
        `[${group.chunks}, ${group.chunk}], this runtime in [${chunks}, ${chunk}]`);
    }
  }
}

export class Optimizer {
  static async create(optimizerModel, module, options = module?.options ?? {}) {
    if (!(module instanceof Module)) throw new OnnxtrainError('Optimizer.create needs a Module');
    const bytes = await modelBytes(optimizerModel, 'optimizer model');
    const meta = readMetadata(bytes, OPTIMIZER_METADATA_KEY, 'optimizer model');
    checkLayout(meta, module.buffers.layout);
    const session = await createSession(bytes, options, 'optimizer model');
    return new Optimizer(session, meta, module);
  }

  constructor(session, meta, module) {
    this.session = session;
    this.meta = meta;
    this.module = module;
    this.trainStep = null; // {session, meta, checker} of the train-step model, once loaded
    this.state = module.state;
    this.buffers = module.buffers;
    this.buffers.addStates(meta.states, this.state.savedOptimizerStates);
    this.learningRate = this.state.learningRate ?? meta.hyperparameters.lr;
    this.state.learningRate = this.learningRate;
  }

  /** The learning rate, the step number and the flat vectors (gradients too when given), by input name. */
  flatFeeds(step, grads) {
    const buffers = this.buffers;
    const feeds = {
      [LEARNING_RATE]: new ort.Tensor('float32', new Float32Array([this.learningRate]), []),
      [STEP]: new ort.Tensor('int64', new BigInt64Array([BigInt(step)]), []),
    };
    for (const dtype of buffers.layout.dtypes) {
      const rows = buffers.layout.rows(dtype);
      feeds[flatName(PARAMS, dtype)] = new ort.Tensor(dtype, buffers.params.get(dtype), rows);
      if (grads) feeds[flatName(GRADIENTS, dtype)] = new ort.Tensor(dtype, grads.get(dtype), rows);
      for (const s of this.meta.states) feeds[flatName(s, dtype)] = new ort.Tensor(dtype, buffers.states.get(s).get(dtype), rows);
    }
    return feeds;
  }

  /** The new vectors of a run's results become the live ones; the step is taken. */
  takeStep(results, step) {
    const buffers = this.buffers;
    const params = new Map();
    const states = new Map(this.meta.states.map((s) => [s, new Map()]));
    for (const dtype of buffers.layout.dtypes) {
      params.set(dtype, results[updatedName(flatName(PARAMS, dtype))].data);
      for (const s of this.meta.states) states.get(s).set(dtype, results[updatedName(flatName(s, dtype))].data);
    }
    buffers.swap(params, states);
    this.state.optimizerStep = step;
  }

  /** Update every trainable parameter with the accumulated gradients. */
  async step() {
    const step = this.state.optimizerStep + 1;
    const results = await this.session.run(this.flatFeeds(step, this.buffers.gradsForUpdate()));
    this.takeStep(results, step);
  }

  /**
   * Load web artifacts' train_step_model.onnx (URL or bytes): the training and optimizer models of this
   * module and optimizer joined in one graph, which `trainAndStep` then runs.
   */
  async loadTrainStepModel(model, options = this.module.options) {
    const bytes = await modelBytes(model, 'train-step model');
    const meta = readMetadata(bytes, TRAINING_METADATA_KEY, 'train-step model');
    if (meta.kind !== 'train_step') {
      throw new OnnxtrainError(`this is the ${meta.kind} model; pass train_step_model.onnx of web artifacts`);
    }
    const optMeta = readMetadata(bytes, OPTIMIZER_METADATA_KEY, 'train-step model');
    const trainMeta = this.module.train_.meta;
    const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
    if (!same(meta.trainable, trainMeta.trainable) || !same(meta.user_inputs, trainMeta.user_inputs) ||
        !same(meta.frozen, trainMeta.frozen) || !same(optMeta, this.meta)) {
      throw new OnnxtrainError('the train-step model comes from other artifacts than the training and optimizer ' +
        'models; use the train_step_model.onnx generated with them');
    }
    const session = await createSession(bytes, options, 'train-step model');
    this.trainStep = { session, meta, checker: new InputChecker(session, meta.user_inputs, meta.input_checks ?? {}) };
  }

  /**
   * A training step, an optimizer step and a gradient reset; returns the model outputs (the loss first).
   * With the train-step model loaded and the gradients reset (no accumulated ones), one session call does
   * it all; otherwise Module.trainStep, step and lazyResetGrad do, with the same result.
   */
  async trainAndStep(feeds) {
    const module = this.module;
    if (!this.trainStep || !this.buffers.gradsZero) {
      const outputs = await module.trainStep(feeds);
      await this.step();
      module.lazyResetGrad();
      return outputs;
    }
    if (!module.training) throw new OnnxtrainError('the Module is in eval mode; call train() before trainAndStep');
    const { session, meta, checker } = this.trainStep;
    const step = this.state.optimizerStep + 1;
    const all = { ...checker.check(feeds), ...this.flatFeeds(step, null) };
    for (const name of meta.frozen) {
      const p = this.state.parameters.get(name);
      all[name] = new ort.Tensor(p.dtype, this.state.array(name), p.shape);
    }
    const results = await session.run(all);
    this.takeStep(results, step);
    return Object.fromEntries(meta.outputs.map((n) => [n, results[n]]));
  }

  setLearningRate(learningRate) {
    this.learningRate = learningRate;
    this.state.learningRate = learningRate;
  }

  getLearningRate() {
    return this.learningRate;
  }
}
