// Just enough protobuf to read an ONNX model's metadata_props (ModelProto field 14, each a
// StringStringEntryProto with key = 1 and value = 2) without loading the graph.
import { OnnxtrainError } from './format.js';

function varint(bytes, pos) {
  let value = 0;
  let scale = 1;
  for (;;) {
    if (pos >= bytes.length) throw new OnnxtrainError('truncated protobuf varint');
    const b = bytes[pos++];
    value += (b & 0x7f) * scale;
    if (b < 0x80) return [value, pos];
    scale *= 128;
  }
}

function* fields(bytes, start = 0, end = bytes.length) {
  let pos = start;
  while (pos < end) {
    let key;
    [key, pos] = varint(bytes, pos);
    const field = Math.floor(key / 8);
    const wire = key & 7;
    if (wire === 0) {
      [, pos] = varint(bytes, pos);
      yield [field, wire, null];
    } else if (wire === 1) {
      pos += 8;
      yield [field, wire, null];
    } else if (wire === 5) {
      pos += 4;
      yield [field, wire, null];
    } else if (wire === 2) {
      let length;
      [length, pos] = varint(bytes, pos);
      if (pos + length > end) throw new OnnxtrainError('truncated protobuf field');
      yield [field, wire, bytes.subarray(pos, pos + length)];
      pos += length;
    } else {
      throw new OnnxtrainError(`not an ONNX model (protobuf wire type ${wire})`);
    }
  }
}

const utf8 = new TextDecoder();

/** The metadata_props of an ONNX model file, as a Map from key to value. */
export function modelMetadata(bytes) {
  const out = new Map();
  for (const [field, wire, value] of fields(bytes)) {
    if (field !== 14 || wire !== 2) continue;
    let key = '';
    let text = '';
    for (const [f, w, v] of fields(value)) {
      if (w !== 2) continue;
      if (f === 1) key = utf8.decode(v);
      if (f === 2) text = utf8.decode(v);
    }
    out.set(key, text);
  }
  return out;
}
