// Module: the training and eval models over one CheckpointState (docs/format.md, "Training step").
import * as ort from 'onnxruntime-web';
import { CheckpointState } from './checkpoint.js';
import { FlatBuffers, FlatLayout } from './buffers.js';
import { OnnxtrainError, TRAINING_METADATA_KEY, TRAINING_MODEL_FORMAT } from './format.js';
import { createSession, InputChecker, modelBytes, readMetadata } from './session.js';

/** The checkpoint and a model must name the same parameters, with the same shapes and trainability. */
export function checkAgreement(state, meta, session, what) {
  const used = [...meta.trainable, ...meta.frozen];
  const names = [...state.parameters.keys()];
  const missing = used.filter((n) => !state.parameters.has(n));
  if (missing.length) throw new OnnxtrainError(`the checkpoint lacks parameters [${missing.slice(0, 10)}] that the ${what} needs; use the checkpoint generated with this training model`);
  const extra = names.filter((n) => !used.includes(n));
  if (extra.length) throw new OnnxtrainError(`the checkpoint has parameters [${extra.slice(0, 10)}] that the ${what} does not use; it comes from other artifacts`);
  const declared = new Map((session.inputMetadata ?? []).map((m) => [m.name, m.shape]));
  for (const name of used) {
    const want = declared.get(name);
    const have = state.parameters.get(name).shape;
    if (want && (want.length !== have.length || want.some((w, i) => typeof w === 'number' && w >= 0 && w !== have[i]))) {
      throw new OnnxtrainError(`parameter ${JSON.stringify(name)} has shape [${have}] in the checkpoint but [${want}] in the ${what}`);
    }
  }
  const notTrainable = meta.trainable.filter((n) => !state.parameters.get(n).requiresGrad);
  if (notTrainable.length) throw new OnnxtrainError(`the ${what} trains [${notTrainable.slice(0, 10)}], which the checkpoint marks requires_grad=false`);
  const notFrozen = names.filter((n) => state.parameters.get(n).requiresGrad && !meta.trainable.includes(n));
  if (notFrozen.length) throw new OnnxtrainError(`the checkpoint marks [${notFrozen.slice(0, 10)}] requires_grad=true, which the ${what} keeps frozen`);
}

class Runner {
  constructor(session, meta) {
    this.session = session;
    this.meta = meta;
    this.checker = new InputChecker(session, meta.user_inputs, meta.input_checks ?? {});
  }

  async run(state, buffers, feeds) {
    const all = { ...this.checker.check(feeds) };
    for (const name of [...this.meta.trainable, ...this.meta.frozen]) {
      const p = state.parameters.get(name);
      all[name] = new ort.Tensor(p.dtype, state.array(name), p.shape);
    }
    return this.session.run(all);
  }
}

export class Module {
  /**
   * @param trainModel training_model.onnx (URL or bytes); evalModel likewise, optional.
   * @param options {executionProviders?, sessionOptions?} for every session of this module.
   */
  static async create(trainModel, state, evalModel = null, options = {}) {
    if (!(state instanceof CheckpointState)) throw new OnnxtrainError('Module.create needs a CheckpointState');
    const bytes = await modelBytes(trainModel, 'training model');
    const meta = readMetadata(bytes, TRAINING_METADATA_KEY, 'training model');
    if (meta.kind !== 'training') {
      throw new OnnxtrainError(`this is the ${meta.kind} model; pass training_model.onnx as the training model`);
    }
    if ((meta.format ?? 1) > TRAINING_MODEL_FORMAT || meta.loss_scaling !== undefined) {
      throw new OnnxtrainError(`the training model has format ${meta.format}` +
        (meta.loss_scaling !== undefined ? ' (fp16 artifacts with loss scaling)' : '') +
        `; onnxtrain-web trains format ${TRAINING_MODEL_FORMAT} and below: generate the artifacts with ` +
        "precision='fp32' or 'bf16'");
    }
    if ((meta.format ?? 1) < TRAINING_MODEL_FORMAT) {
      console.warn('onnxtrain-web: the training model comes from an earlier onnxtrain; generate the artifacts again');
    }
    const session = await createSession(bytes, options, 'training model');
    checkAgreement(state, meta, session, 'training model');
    let evalRunner = null;
    if (evalModel !== null && evalModel !== undefined) {
      const evalBytes = await modelBytes(evalModel, 'eval model');
      const evalMeta = readMetadata(evalBytes, TRAINING_METADATA_KEY, 'eval model');
      const evalSession = await createSession(evalBytes, options, 'eval model');
      checkAgreement(state, evalMeta, evalSession, 'eval model');
      evalRunner = new Runner(evalSession, evalMeta);
    }
    return new Module(state, new Runner(session, meta), evalRunner, options);
  }

  constructor(state, train, evalRunner, options) {
    this.state = state;
    this.options = options;
    this.train_ = train;
    this.eval_ = evalRunner;
    if (state.buffers) {
      if (state.buffers.layout.names.join('\n') !== train.meta.trainable.join('\n')) {
        throw new OnnxtrainError('this CheckpointState is already used by a Module with other trainable parameters');
      }
    } else {
      state.buffers = new FlatBuffers(new FlatLayout(train.meta.trainable, state.parameters), state);
    }
    this.buffers = state.buffers;
    this.gradNames = new Map(train.meta.trainable.map((n, i) => [n, train.meta.gradients[i]]));
    this.training = true;
  }

  train(mode = true) {
    this.training = mode;
    return this;
  }

  eval() {
    return this.train(false);
  }

  get trainingInputNames() { return this.train_.meta.user_inputs.slice(); }
  get trainingOutputNames() { return this.train_.meta.outputs.slice(); }
  get evalInputNames() { return (this.eval_ ?? this.train_).meta.user_inputs.slice(); }
  get evalOutputNames() { return (this.eval_ ?? this.train_).meta.outputs.slice(); }

  /** Forward and backward: returns the model outputs (the loss first); gradients add up until lazyResetGrad. */
  async trainStep(feeds) {
    if (!this.training) throw new OnnxtrainError('the Module is in eval mode; call train() before trainStep');
    const results = await this.train_.run(this.state, this.buffers, feeds);
    const overwrite = this.buffers.gradsZero;
    for (const [name, gradName] of this.gradNames) {
      const target = this.buffers.gradView(name);
      const grad = results[gradName].data;
      if (overwrite) target.set(grad);
      else for (let i = 0; i < target.length; i++) target[i] += grad[i];
    }
    this.buffers.gradsZero = false;
    return Object.fromEntries(this.train_.meta.outputs.map((n) => [n, results[n]]));
  }

  /** The eval model's outputs (the loss first) with the current parameters. */
  async evalStep(feeds) {
    if (!this.eval_) throw new OnnxtrainError('this Module was created without an eval model; pass it to Module.create');
    const results = await this.eval_.run(this.state, this.buffers, feeds);
    return Object.fromEntries(this.eval_.meta.outputs.map((n) => [n, results[n]]));
  }

  /** Gradients count as zero from now: the next training step overwrites them instead of adding. */
  lazyResetGrad() {
    this.buffers.resetGrad();
  }

  paramNames(trainableOnly) {
    return [...this.state.parameters].filter(([, p]) => !trainableOnly || p.requiresGrad).map(([n]) => n);
  }

  getParametersSize(trainableOnly = true) {
    return this.paramNames(trainableOnly).reduce((sum, n) => sum + this.state.array(n).length, 0);
  }

  /** A copy of the parameters (checkpoint order) in one float32 tensor. */
  getContiguousParameters(trainableOnly = false) {
    const names = this.paramNames(trainableOnly);
    const types = new Set(names.map((n) => this.state.parameters.get(n).dtype));
    if (types.size > 1) throw new OnnxtrainError(`the parameters have several element types [${[...types]}]; one contiguous buffer needs one`);
    const out = new Float32Array(this.getParametersSize(trainableOnly));
    let pos = 0;
    for (const n of names) {
      const data = this.state.array(n);
      out.set(data, pos);
      pos += data.length;
    }
    return new ort.Tensor('float32', out, [out.length]);
  }

  /** Copy a flat buffer (Float32Array, its bytes, or a tensor as from getContiguousParameters) into the parameters. */
  loadParametersBuffer(buffer, trainableOnly = true) {
    let flat = buffer instanceof ort.Tensor ? buffer.data : buffer;
    if (flat instanceof Uint8Array) flat = new Float32Array(flat.slice().buffer);
    if (!(flat instanceof Float32Array)) throw new OnnxtrainError('loadParametersBuffer needs a Float32Array, its bytes, or a float32 tensor');
    const size = this.getParametersSize(trainableOnly);
    if (flat.length !== size) {
      throw new OnnxtrainError(`the buffer has ${flat.length} elements; the ${trainableOnly ? 'trainable ' : ''}parameters have ${size}`);
    }
    let pos = 0;
    for (const n of this.paramNames(trainableOnly)) {
      const target = this.state.array(n);
      target.set(flat.subarray(pos, pos + target.length));
      pos += target.length;
    }
  }
}
