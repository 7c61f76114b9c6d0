// HuggingFace tokenizers (native Rust build, npm @anush008/tokenizers) on the same corpus:
// sequential encodes (one at a time, like the m3 run), best of REPEAT runs.
// Usage: node tokenizer_peer.js TOKENIZER_JSON CORPUS.jsonl [REPEAT]
const fs = require('fs');
const { Tokenizer } = require('@anush008/tokenizers');
(async () => {
  const [tokPath, corpus, repeatArg] = process.argv.slice(2);
  const tok = Tokenizer.fromFile(tokPath);
  const docs = fs.readFileSync(corpus, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l).text);
  const bytes = docs.reduce((n, d) => n + Buffer.byteLength(d, 'utf8'), 0);
  let best = Infinity, tokens = 0;
  for (let r = 0; r < Number(repeatArg || 3); ++r) {
    tokens = 0;
    const t0 = process.hrtime.bigint();
    for (const d of docs) tokens += (await tok.encode(d, null, { addSpecialTokens: false })).getIds().length;
    best = Math.min(best, Number(process.hrtime.bigint() - t0) / 1e9);
  }
  console.log(JSON.stringify({ bench: 'tokenizer_encode', impl: 'hf-tokenizers', threads: 1, bytes, tokens,
                               seconds: best, value: bytes / best / 1e6, unit: 'MB/s' }));
})();
