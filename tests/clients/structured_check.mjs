// Structured output through the official clients, validated by an independent JSON-schema
// validator (ajv, draft 2020-12, with ajv-formats): every schema of tests/constrain_schemas.json
// as a strict response_format json_schema, TRIALS times each with a different seed, thinking on for
// half of them (the reasoning stays free, the answer follows the schema), on the random tiny
// model, so that nothing but the constraint makes the replies valid. Then json_object, forced tool
// calls (tool_choice "required" and named, parallel_tool_calls false), strict tools in auto mode,
// a streamed reply, the Anthropic client's tool_choice any / tool, and requests the server must
// refuse by name. Exits non-zero on any failure; prints the counts.
// Usage: node structured_check.mjs BASE_URL API_KEY SCHEMAS_JSON [TRIALS]
import fs from 'node:fs';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import Ajv2020 from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';

const [baseURL, apiKey, schemasPath, trialsArg] = process.argv.slice(2);
if (!baseURL || !apiKey || !schemasPath) {
  console.error('usage: node structured_check.mjs BASE_URL API_KEY SCHEMAS_JSON [TRIALS]');
  process.exit(2);
}
const trials = Number(trialsArg ?? 10);
const schemas = JSON.parse(fs.readFileSync(schemasPath, 'utf8'));
const openai = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey, maxRetries: 0, timeout: 300_000 });
const anthropic = new Anthropic({ baseURL, apiKey, maxRetries: 0, timeout: 300_000 });
const ajv = new Ajv2020({ allErrors: true, strict: false });
addFormats(ajv);

const failures = [];
const counts = { valid: 0, trials: 0, tokens: 0, reasoning: 0 };
const show = (v) => JSON.stringify(v).slice(0, 300);
const fail = (what) => failures.push(what);

// Checks one reply's JSON text against a schema; true when valid.
function validates(text, schema, what) {
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    fail(`${what}: not JSON: ${show(text)}`);
    return false;
  }
  const validate = ajv.compile(schema);
  if (!validate(value)) {
    fail(`${what}: ${show(value)} fails the schema: ${ajv.errorsText(validate.errors)}`);
    return false;
  }
  return true;
}

// Runs `jobs` (functions returning promises) two at a time: the server batches two slots.
async function runAll(jobs, width = 2) {
  let next = 0;
  await Promise.all(Array.from({ length: width }, async () => {
    while (next < jobs.length) await jobs[next++]();
  }));
}

const user = (text) => [{ role: 'user', content: text }];
const thinking = (on) => ({ chat_template_kwargs: { thinking_mode: on ? 'enabled' : 'disabled' } });

// 1. response_format json_schema (strict), every schema TRIALS times.
const jobs = [];
schemas.forEach((s, i) => {
  for (let k = 0; k < trials; ++k) {
    jobs.push(async () => {
      const what = `json_schema ${s.name} seed ${1000 * i + k}`;
      counts.trials += 1;
      try {
        const r = await openai.chat.completions.create({
          model: 'tiny', messages: user(`Reply with ${s.name} as JSON.`), max_tokens: 256, temperature: 1.0,
          seed: 1000 * i + k, response_format: { type: 'json_schema', json_schema: { name: s.name, schema: s.schema, strict: true } },
          ...thinking(k % 2 === 1),
        });
        const c = r.choices[0];
        if (c.finish_reason !== 'stop') fail(`${what}: finish_reason ${c.finish_reason}`);
        if (validates(c.message.content, s.schema, what)) counts.valid += 1;
        counts.tokens += r.usage.completion_tokens;
        if (c.message.reasoning_content) counts.reasoning += 1;
      } catch (e) {
        fail(`${what}: ${e.message}`);
      }
    });
  }
});
await runAll(jobs);

// 2. json_object, streamed and whole.
for (let k = 0; k < 4; ++k) {
  const req = { model: 'tiny', messages: user('Any JSON object.'), max_tokens: 128, temperature: 1.0, seed: k,
                response_format: { type: 'json_object' } };
  let text = '';
  if (k % 2) {
    for await (const chunk of await openai.chat.completions.create({ ...req, stream: true }))
      text += chunk.choices[0]?.delta?.content ?? '';
  } else {
    text = (await openai.chat.completions.create(req)).choices[0].message.content;
  }
  validates(text, { type: 'object' }, `json_object ${k % 2 ? 'streamed' : 'whole'} seed ${k}`);
}

// 3. Forced tool calls: "required" over three tools, a named one, a single call.
const byName = Object.fromEntries(schemas.map((s) => [s.name, s.schema]));
// (anyOf other than X-or-null has no markup that tells its branches apart: refused for tools.)
const tools = ['weather_args', 'nested_order', 'person'].map((name) => ({
  type: 'function', function: { name, description: `the ${name} tool`, parameters: byName[name] },
}));
const checkCalls = (r, what, allowed, single) => {
  const c = r.choices[0];
  const calls = c.message.tool_calls ?? [];
  if (c.finish_reason !== 'tool_calls' || calls.length === 0) return fail(`${what}: no tool call: ${show(c)}`);
  if (single && calls.length !== 1) fail(`${what}: ${calls.length} calls with parallel_tool_calls false`);
  for (const call of calls) {
    if (!allowed.includes(call.function.name)) fail(`${what}: called ${call.function.name}`);
    else validates(call.function.arguments, byName[call.function.name], `${what} ${call.function.name}`);
  }
  counts.toolCalls = (counts.toolCalls ?? 0) + calls.length;
};
for (let k = 0; k < 6; ++k) {
  const base = { model: 'tiny', messages: user('Use a tool.'), tools, max_tokens: 400, temperature: 1.0, seed: 50 + k,
                 ...thinking(k % 3 === 0) };
  try {
    checkCalls(await openai.chat.completions.create({ ...base, tool_choice: 'required' }), `required seed ${k}`,
               tools.map((t) => t.function.name), false);
    checkCalls(await openai.chat.completions.create({ ...base, tool_choice: { type: 'function', function: { name: 'weather_args' } },
                                                      parallel_tool_calls: false }),
               `named seed ${k}`, ['weather_args'], true);
  } catch (e) {
    fail(`forced tool call seed ${k}: ${e.message}`);
  }
}

// 4. Strict tools in auto mode: a call, if the model makes one, follows its schema.
const strictTools = tools.map((t) => ({ ...t, function: { ...t.function, strict: true } }));
for (let k = 0; k < 4; ++k) {
  try {
    const r = await openai.chat.completions.create({ model: 'tiny', messages: user('Maybe use a tool.'), tools: strictTools,
                                                     max_tokens: 200, temperature: 1.0, seed: 70 + k });
    for (const call of r.choices[0].message.tool_calls ?? [])
      validates(call.function.arguments, byName[call.function.name] ?? {}, `strict auto seed ${k}`);
  } catch (e) {
    fail(`strict auto seed ${k}: ${e.message}`);
  }
}
// A tool whose schema the markup cannot carry is refused by name, not called unchecked.
try {
  await openai.chat.completions.create({ model: 'tiny', messages: user('x'), max_tokens: 64, tool_choice: 'required',
    tools: [{ type: 'function', function: { name: 'plan', parameters: byName.agent_plan } }] });
  fail('tool with anyOf: accepted');
} catch (e) {
  if (!(e instanceof OpenAI.BadRequestError) || !e.message.includes('anyOf')) fail(`tool with anyOf: ${e.message}`);
}

// 5. The Anthropic client: tool_choice any and tool; the tool_use inputs follow the schemas.
for (let k = 0; k < 4; ++k) {
  const atools = tools.map((t) => ({ name: t.function.name, description: t.function.description, input_schema: t.function.parameters }));
  for (const choice of [{ type: 'any' }, { type: 'tool', name: 'nested_order', disable_parallel_tool_use: true }]) {
    const what = `anthropic tool_choice ${choice.type} seed ${k}`;
    try {
      const m = await anthropic.messages.create({ model: 'tiny', max_tokens: 400, temperature: 1.0, tools: atools, tool_choice: choice,
                                                  messages: [{ role: 'user', content: 'Use a tool.' }] });
      const uses = m.content.filter((b) => b.type === 'tool_use');
      if (m.stop_reason !== 'tool_use' || uses.length === 0) fail(`${what}: no tool_use: ${show(m)}`);
      if (choice.type === 'tool' && uses.length !== 1) fail(`${what}: ${uses.length} calls`);
      for (const u of uses) validates(JSON.stringify(u.input), byName[u.name] ?? {}, `${what} ${u.name}`);
    } catch (e) {
      fail(`${what}: ${e.message}`);
    }
  }
}

// 6. Refused by name: what the grammar engine does not do must not be silently ignored.
const refusals = [
  [{ type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', not: { required: ['a'] } } } }, 'not'],
  [{ type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', format: 'hostname-idn' } } }, 'format'],
  [{ type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', patternProperties: { '^a': {} } } } }, 'patternProperties'],
];
for (const [format, word] of refusals) {
  try {
    await openai.chat.completions.create({ model: 'tiny', messages: user('x'), max_tokens: 64, response_format: format });
    fail(`refusal ${word}: accepted`);
  } catch (e) {
    if (!(e instanceof OpenAI.BadRequestError) || !e.message.includes(word)) fail(`refusal ${word}: ${e.message}`);
  }
}

console.log(`structured: ${counts.valid}/${counts.trials} json_schema replies valid over ${schemas.length} schemas ` +
            `(${trials} seeds each, ${counts.reasoning} with reasoning first, ${counts.tokens} completion tokens); ` +
            `${counts.toolCalls ?? 0} forced tool calls checked`);
if (failures.length) {
  console.log(`FAILED ${failures.length}:\n  ${failures.slice(0, 40).join('\n  ')}`);
  process.exit(1);
}
console.log('ok');
