// GET /metrics of a running `m3 serve`, after some traffic, read by a Prometheus text-format parser
// (parse-prometheus-text-format, pinned in package.json; it throws on a line it cannot read) and
// checked line by line against the exposition format 0.0.4 (names, labels, values, one TYPE per
// family before its samples, families not interleaved), then for what m3 reports: requests by
// endpoint and status, histograms (cumulative buckets ending in +Inf = _count, _sum) for time to
// first token, inter-token latency, request duration and prompt length, token-rate, cache and
// queue gauges. Exits non-zero on any failure.
// Usage: node metrics_check.mjs BASE_URL API_KEY   (driver: tests/node_client_check.py)
import parsePrometheusTextFormat from 'parse-prometheus-text-format';
import { check, failures, runChecks, serverArgs, show } from './check_util.mjs';

const [baseURL, apiKey] = serverArgs('metrics_check.mjs');
const headers = { Authorization: `Bearer ${apiKey}`, 'Content-Type': 'application/json' };
const post = (path, body) => fetch(`${baseURL}${path}`, { method: 'POST', headers, body: JSON.stringify(body) });
const chat = { model: 'tiny', max_tokens: 6, temperature: 0, messages: [{ role: 'user', content: 'Hello!' }] };

// The exposition format, strictly: returns the problems found.
function lint(text) {
  const problems = [];
  const name = '[a-zA-Z_:][a-zA-Z0-9_:]*';
  const value = '(?:[+-]?Inf|NaN|[+-]?(?:\\d+\\.?\\d*|\\.\\d+)(?:[eE][+-]?\\d+)?)';
  const labelValue = '"(?:[^"\\\\\\n]|\\\\[\\\\"n])*"';
  const labels = `\\{(?:[a-zA-Z_][a-zA-Z0-9_]*=${labelValue}(?:,[a-zA-Z_][a-zA-Z0-9_]*=${labelValue})*,?)?\\}`;
  const sample = new RegExp(`^(${name})(${labels})? (${value})(?: -?\\d+)?$`);
  const types = new Map();
  const done = new Set();
  let current = null;
  let lastBucket = { family: null, bound: -Infinity };
  const familyOf = (metric) => {
    for (const suffix of ['_bucket', '_sum', '_count']) {
      if (metric.endsWith(suffix) && types.get(metric.slice(0, -suffix.length)) === 'histogram')
        return metric.slice(0, -suffix.length);
    }
    return metric;
  };
  if (!text.endsWith('\n')) problems.push('the text does not end with a newline');
  const lines = text.split('\n').slice(0, -1);
  for (const line of lines) {
    if (line.startsWith('#')) {
      const m = /^# (HELP|TYPE) (\S+) ?(.*)$/.exec(line);
      if (!m) continue;  // a plain comment
      if (!new RegExp(`^${name}$`).test(m[2])) problems.push(`bad metric name: ${line}`);
      if (m[1] === 'TYPE') {
        if (types.has(m[2])) problems.push(`a second TYPE: ${line}`);
        if (!['counter', 'gauge', 'histogram', 'summary', 'untyped'].includes(m[3])) problems.push(`bad type: ${line}`);
        types.set(m[2], m[3]);
      }
      if (current !== m[2]) {
        if (current) done.add(current);
        if (done.has(m[2])) problems.push(`family ${m[2]} comes back: ${line}`);
        current = m[2];
      }
      continue;
    }
    if (line.trim() === '') continue;
    const m = sample.exec(line);
    if (!m) {
      problems.push(`not a sample line: ${line}`);
      continue;
    }
    const family = familyOf(m[1]);
    if (!types.has(family)) problems.push(`a sample before its TYPE: ${line}`);
    if (m[1].endsWith('_bucket') && family !== m[1]) {  // a histogram's buckets: le ascending, +Inf last
      const le = /le="([^"]*)"/.exec(m[2] ?? '');
      const bound = le ? (le[1] === '+Inf' ? Infinity : Number(le[1])) : NaN;
      if (Number.isNaN(bound)) problems.push(`a bucket without a numeric le: ${line}`);
      else if (lastBucket.family === family && !(bound > lastBucket.bound)) problems.push(`le not ascending: ${line}`);
      lastBucket = { family, bound };
    } else if (m[1] === `${family}_sum` && types.get(family) === 'histogram' && lastBucket.bound !== Infinity) {
      problems.push(`no +Inf bucket before ${line}`);
    }
    if (family !== current) {
      if (current) done.add(current);
      if (done.has(family)) problems.push(`family ${family} comes back: ${line}`);
      current = family;
    }
  }
  return problems;
}

async function main() {
  // Traffic: completions well and badly asked, streamed, n = 2, a tokenize, a missing page.
  let generated = 0;
  for (const body of [chat, { ...chat, n: 2, temperature: 1, seed: 1 }]) {
    const r = await post('/v1/chat/completions', body);
    check(r.status === 200, `chat ${show(body)}: ${r.status}`);
    generated += (await r.json()).usage?.completion_tokens ?? 0;
  }
  const stream = await post('/v1/chat/completions', { ...chat, stream: true, stream_options: { include_usage: true } });
  const events = (await stream.text()).split('\n\n').filter((e) => e.startsWith('data: {'));
  generated += JSON.parse(events.at(-1).slice(6)).usage?.completion_tokens ?? 0;
  check(stream.status === 200, 'stream 200');
  check((await post('/v1/chat/completions', { ...chat, temperature: -1 })).status === 400, 'chat 400');
  check((await post('/tokenize', { content: 'Hello world' })).status === 200, 'tokenize 200');
  check((await post('/detokenize', { tokens: [1e9] })).status === 400, 'detokenize 400');
  check((await fetch(`${baseURL}/v1/models/nope`, { headers })).status === 404, 'model page 404');
  check((await fetch(`${baseURL}/no/such/path`, { headers })).status === 404, 'other 404');

  const res = await fetch(`${baseURL}/metrics`, { headers });
  check(res.status === 200 && (res.headers.get('content-type') ?? '').startsWith('text/plain'),
        `/metrics: ${res.status} ${res.headers.get('content-type')}`);
  const text = await res.text();
  for (const p of lint(text)) failures.push(`exposition format: ${p}`);

  let families = [];
  try {
    families = parsePrometheusTextFormat(text);
  } catch (e) {
    failures.push(`the parser refused the text: ${e?.message}`);
  }
  const byName = new Map(families.map((f) => [f.name, f]));
  check(byName.size === families.length, 'family names are unique');
  for (const f of families) check(f.help && f.help.length > 0, `HELP of ${f.name}`);

  // Requests by endpoint and status.
  const requests = byName.get('m3_requests_total');
  check(requests?.type === 'COUNTER', `m3_requests_total: ${show(requests)}`);
  const count = (endpoint, status) => Number(requests?.metrics.find((m) => m.labels?.endpoint === endpoint
                                                                          && m.labels?.status === String(status))?.value ?? 0);
  check(count('/v1/chat/completions', 200) === 3, `chat 200s: ${show(requests?.metrics)}`);
  check(count('/v1/chat/completions', 400) === 1, 'chat 400s');
  check(count('/tokenize', 200) === 1 && count('/detokenize', 400) === 1, 'tokenize / detokenize');
  check(count('/v1/models/{model}', 404) === 1 && count('other', 404) === 1, 'pages by label, others as "other"');
  const labelSets = requests?.metrics.map((m) => JSON.stringify(m.labels)) ?? [];
  check(new Set(labelSets).size === labelSets.length, 'label sets are unique');

  // Histograms: cumulative buckets, +Inf equal to the count.
  const expectCount = {
    m3_time_to_first_token_seconds: 4,  // four choices generated (n = 2 is two)
    m3_request_duration_seconds: 3,      // three completion requests ran (the 400 never did)
    m3_prompt_tokens: 4,
    m3_inter_token_latency_seconds: generated - 4,  // the gaps after each choice's first token
  };
  for (const [name, want] of Object.entries(expectCount)) {
    const f = byName.get(name);
    check(f?.type === 'HISTOGRAM' && f.metrics.length === 1, `${name}: ${show(f)}`);
    const h = f?.metrics[0];
    if (!h) continue;
    // (The parser keeps buckets in an object, whose integer-like keys come first: sorted here; the
    // text's own order is checked by lint.)
    const le = (b) => (b === '+Inf' ? Infinity : Number(b));
    const bounds = Object.keys(h.buckets).sort((a, b) => le(a) - le(b));
    const counts = bounds.map((b) => Number(h.buckets[b]));
    check(bounds.at(-1) === '+Inf' && bounds.every((b) => !Number.isNaN(le(b))), `${name} bounds: ${bounds}`);
    check(counts.every((c, i) => i === 0 || c >= counts[i - 1]), `${name} cumulative: ${counts}`);
    check(counts.at(-1) === Number(h.count) && Number(h.count) === want, `${name} count ${h.count}, want ${want}`);
    check(Number(h.sum) >= 0 && Number.isFinite(Number(h.sum)), `${name} sum ${h.sum}`);
  }
  const value = (name) => Number(byName.get(name)?.metrics[0]?.value);
  check(value('m3_prefill_tokens_per_second') > 0 && value('m3_decode_tokens_per_second') > 0,
        `token rates: ${value('m3_prefill_tokens_per_second')} ${value('m3_decode_tokens_per_second')}`);
  check(value('m3_cache_bytes') > 0, `cache bytes: ${value('m3_cache_bytes')}`);
  const hit = value('m3_prompt_cache_hit_ratio');
  check(hit > 0 && hit <= 1, `cache hit ratio (the repeated prompt was cached): ${hit}`);
  check(value('m3_generated_tokens_total') === generated,
        `generated tokens: ${value('m3_generated_tokens_total')}, the replies' usage ${generated}`);
  check(value('m3_requests_queued') === 0 && value('m3_requests_generating') === 0 && value('m3_slots') === 2,
        'queue and slots');
  for (const f of families) {
    if (f.type !== 'COUNTER') continue;
    for (const m of f.metrics) check(Number(m.value) >= 0, `counter ${f.name} >= 0`);
  }
}

await runChecks('metrics_check', main);
