// Optimizer: runs the optimizer model over a Module's flat buffers, one session call per step. The model
// reads the live parameters and states and returns new ones (`<input>.out`), which become the live copy.
import * as ort from 'onnxruntime-web';
import { Module } from './module.js';
import {
  flatName, GRADIENTS, LEARNING_RATE, OnnxtrainError, OPTIMIZER_METADATA_KEY, PARAMS, STEP, updatedName,
} from './format.js';
import { createSession, modelBytes, readMetadata } from './session.js';

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
    this.state = module.state;
    this.buffers = module.buffers;
    this.buffers.addStates(meta.states, this.state.savedOptimizerStates);
    this.learningRate = this.state.learningRate ?? meta.hyperparameters.lr;
    this.state.learningRate = this.learningRate;
  }

  /** Update every trainable parameter with the accumulated gradients. */
  async step() {
    const buffers = this.buffers;
    const grads = buffers.gradsForUpdate();
    const step = this.state.optimizerStep + 1;
    const feeds = {
      [LEARNING_RATE]: new ort.Tensor('float32', new Float32Array([this.learningRate]), []),
      [STEP]: new ort.Tensor('int64', new BigInt64Array([BigInt(step)]), []),
    };
    for (const dtype of buffers.layout.dtypes) {
      const rows = buffers.layout.rows(dtype);
      feeds[flatName(PARAMS, dtype)] = new ort.Tensor(dtype, buffers.params.get(dtype), rows);
      feeds[flatName(GRADIENTS, dtype)] = new ort.Tensor(dtype, grads.get(dtype), rows);
      for (const s of this.meta.states) feeds[flatName(s, dtype)] = new ort.Tensor(dtype, buffers.states.get(s).get(dtype), rows);
    }
    const results = await this.session.run(feeds);
    const params = new Map();
    const states = new Map(this.meta.states.map((s) => [s, new Map()]));
    for (const dtype of buffers.layout.dtypes) {
      params.set(dtype, results[updatedName(flatName(PARAMS, dtype))].data);
      for (const s of this.meta.states) states.get(s).set(dtype, results[updatedName(flatName(s, dtype))].data);
    }
    buffers.swap(params, states);
    this.state.optimizerStep = step;
  }

  setLearningRate(learningRate) {
    this.learningRate = learningRate;
    this.state.learningRate = learningRate;
  }

  getLearningRate() {
    return this.learningRate;
  }
}
