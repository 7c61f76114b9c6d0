// The official OpenAI TypeScript SDK (openai, pinned in package.json) against a running `m3 serve`:
// chat.completions.create whole and streamed (the async iterator), n = 2 whole and streamed, logprobs,
// tools with a tool-call round trip (the model's call, or one written here when the tiny model does
// not call), completions (n per prompt, prompt-major), models.list, errors as the SDK's classes
// (BadRequestError with its param, AuthenticationError), and structured output (response_format
// json_schema, a forced tool_choice) validated with ajv (structured_check.mjs runs many more).
// Exits non-zero on any failure.
// Usage: node openai_sdk_check.mjs BASE_URL API_KEY   (driver: tests/node_client_check.py)
import OpenAI from 'openai';
import Ajv from 'ajv';
import { check, expectError, failures, runChecks, serverArgs, show } from './check_util.mjs';

const [baseURL, apiKey] = serverArgs('openai_sdk_check.mjs');
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey, maxRetries: 0, timeout: 120_000 });
const ajv = new Ajv({ allErrors: true, strict: false });

const hello = [{ role: 'user', content: 'Hello! Who are you?' }];
const base = { model: 'tiny', max_tokens: 8, temperature: 0, messages: hello };
const weatherSchema = {
  type: 'object',
  properties: { city: { type: 'string' } },
  required: ['city'],
  additionalProperties: false,
};
const tools = [{
  type: 'function',
  function: { name: 'get_weather', description: 'Weather of a city', parameters: weatherSchema },
}];

// Collects a streamed chat reply per choice index: content, finish_reason, and the usage chunk.
async function collectChat(stream) {
  const choices = new Map();
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks += 1;
    check(chunk.object === 'chat.completion.chunk' && typeof chunk.id === 'string', `chunk: ${show(chunk)}`);
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      const acc = choices.get(c.index) ?? { content: '', reasoning: '', finish: null, logprobs: 0, afterFinish: 0 };
      if (acc.finish) acc.afterFinish += 1;
      acc.content += c.delta?.content ?? '';
      acc.reasoning += c.delta?.reasoning_content ?? '';
      acc.logprobs += c.logprobs?.content?.length ?? 0;
      if (c.finish_reason) acc.finish = c.finish_reason;
      choices.set(c.index, acc);
    }
  }
  return { choices, usage, chunks };
}

async function main() {
  // models.list
  const models = [];
  for await (const m of client.models.list()) models.push(m);
  check(models.length === 1 && models[0].id === 'tiny' && models[0].object === 'model', `models: ${show(models)}`);

  // Whole and streamed: the same reply (the first request caches the prompt, so that both
  // evaluate only its last token).
  await client.chat.completions.create({ ...base, max_tokens: 1 });
  const whole = await client.chat.completions.create(base);
  const msg = whole.choices[0]?.message;
  check(whole.object === 'chat.completion' && whole.choices.length === 1 && msg?.role === 'assistant',
        `whole: ${show(whole)}`);
  check(whole.usage.completion_tokens === 8 && whole.choices[0].finish_reason === 'length', `whole usage: ${show(whole)}`);
  const streamed = await collectChat(await client.chat.completions.create({
    ...base, stream: true, stream_options: { include_usage: true },
  }));
  const s0 = streamed.choices.get(0);
  check(streamed.choices.size === 1 && s0?.finish === 'length' && s0.afterFinish === 0, `stream: ${show([...streamed.choices])}`);
  check(s0?.content === (msg?.content ?? '') && s0?.reasoning === (msg?.reasoning_content ?? ''),
        `stream == whole: ${show(s0)} vs ${show(msg)}`);
  check(streamed.usage?.completion_tokens === 8 && streamed.usage?.prompt_tokens === whole.usage.prompt_tokens,
        `stream usage: ${show(streamed.usage)}`);

  // n = 2, sampled with a seed: two choices; streamed, each with its own finish chunk and the
  // usage of both.
  const sampled = { ...base, temperature: 1, seed: 7, max_tokens: 6, n: 2 };
  const two = await client.chat.completions.create(sampled);
  check(two.choices.length === 2 && two.choices.map((c) => c.index).join() === '0,1'
        && two.choices.every((c) => c.message.role === 'assistant' && c.finish_reason),
        `n=2: ${show(two.choices)}`);
  check(two.usage.completion_tokens === 12 && two.usage.prompt_tokens === whole.usage.prompt_tokens,
        `n=2 usage (the prompt once, the outputs summed): ${show(two.usage)}`);
  const twoStream = await collectChat(await client.chat.completions.create({
    ...sampled, stream: true, stream_options: { include_usage: true },
  }));
  check(twoStream.choices.size === 2 && [0, 1].every((i) => twoStream.choices.get(i)?.finish === 'length'
                                                        && twoStream.choices.get(i)?.afterFinish === 0),
        `n=2 streamed: ${show([...twoStream.choices])}`);
  check(twoStream.usage?.completion_tokens === 12, `n=2 streamed usage: ${show(twoStream.usage)}`);

  // logprobs, per choice.
  const lp = await client.chat.completions.create({ ...base, n: 2, logprobs: true, top_logprobs: 2, max_tokens: 4 });
  check(lp.choices.length === 2 && lp.choices.every((c) => c.logprobs?.content?.length === 4
        && c.logprobs.content.every((t) => typeof t.logprob === 'number' && t.logprob <= 0 && t.top_logprobs.length === 2
                                         && Array.isArray(t.bytes))),
        `logprobs: ${show(lp.choices.map((c) => c.logprobs))}`);
  const lpStream = await collectChat(await client.chat.completions.create({
    ...base, logprobs: true, max_tokens: 4, stream: true,
  }));
  check(lpStream.choices.get(0)?.logprobs === 4, `streamed logprobs: ${show([...lpStream.choices])}`);

  // Tools: a call (the model's, or one written here) goes back with its result; call ids are
  // unique, also across the choices of one request and across requests.
  const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const first = await client.chat.completions.create({ ...base, max_tokens: 24, tools, tool_choice: 'auto', messages: ask });
  const choice = first.choices[0];
  check(['stop', 'length', 'tool_calls'].includes(choice.finish_reason), `tools: ${show(first)}`);
  let calls = choice.message.tool_calls ?? [];
  for (const c of calls) {
    check(c.type === 'function' && typeof c.id === 'string' && c.id.startsWith('call_') && typeof c.function.arguments === 'string',
          `tool call shape: ${show(c)}`);
  }
  let assistant = choice.message;
  if (calls.length === 0) {
    console.log('note: the tiny model made no tool call; the round trip uses one written here');
    calls = [{ id: 'call_client_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }];
    assistant = { role: 'assistant', content: null, tool_calls: calls };
  }
  const second = await client.chat.completions.create({
    ...base, tools,
    messages: [...ask, assistant, ...calls.map((c) => ({ role: 'tool', tool_call_id: c.id, content: 'Rain, 12 C' }))],
  });
  check(second.choices[0].message.role === 'assistant', `tool round trip: ${show(second)}`);

  // Completions: n per prompt, prompt-major.
  const comp = await client.completions.create({ model: 'tiny', prompt: 'Once upon a time', max_tokens: 5, temperature: 0 });
  check(comp.object === 'text_completion' && comp.choices.length === 1 && typeof comp.choices[0].text === 'string'
        && comp.usage.completion_tokens === 5, `completion: ${show(comp)}`);
  const grid = await client.completions.create({
    model: 'tiny', prompt: ['Once upon a time', 'The weather'], n: 2, max_tokens: 3, temperature: 0,
  });
  check(grid.choices.length === 4 && grid.choices.map((c) => c.index).join() === '0,1,2,3',
        `completions n=2 x 2 prompts: ${show(grid.choices)}`);
  // Greedy: the two choices of a prompt agree, and prompt 0's are the single completion's start.
  check(grid.choices[0].text === grid.choices[1].text && grid.choices[2].text === grid.choices[3].text
        && comp.choices[0].text.startsWith(grid.choices[0].text),
        `completions prompt-major order: ${show(grid.choices.map((c) => c.text))} vs ${show(comp.choices[0].text)}`);
  let compStreamed = '';
  const compStream = await client.completions.create({ model: 'tiny', prompt: 'Once upon a time', max_tokens: 5,
                                                       temperature: 0, stream: true });
  for await (const chunk of compStream) compStreamed += chunk.choices[0]?.text ?? '';
  check(compStreamed === comp.choices[0].text, `completion streamed: ${show(compStreamed)} vs ${show(comp.choices[0].text)}`);

  // Errors as the SDK's classes.
  const badN = await expectError('n = 99', OpenAI.BadRequestError, () => client.chat.completions.create({ ...base, n: 99 }));
  check(badN?.status === 400 && badN?.param === 'n', `n = 99: ${badN?.status} ${badN?.param} ${badN?.message}`);
  const badFreq = await expectError('frequency_penalty = 3', OpenAI.BadRequestError,
                                    () => client.chat.completions.create({ ...base, frequency_penalty: 3 }));
  check(badFreq?.param === 'frequency_penalty', `frequency_penalty = 3: ${badFreq?.param} ${badFreq?.message}`);
  await client.chat.completions.create({ ...base, frequency_penalty: 1.5, presence_penalty: 0.5 });
  const wrongKey = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'wrong', maxRetries: 0 });
  const auth = await expectError('wrong key', OpenAI.AuthenticationError, () => wrongKey.models.list());
  check(auth?.status === 401, `wrong key: ${auth?.status}`);
  await expectError('unknown model page', OpenAI.NotFoundError, () => client.models.retrieve('nope'));

  // Structured output (the server's constrained decoding): the reply is JSON of the schema.
  const cityFormat = { type: 'json_schema', json_schema: { name: 'city', schema: weatherSchema, strict: true } };
  const structured = await client.chat.completions.create(
                                 { ...base, max_tokens: 64, messages: ask, response_format: cityFormat });
  {
    const content = structured.choices[0].message.content;
    let parsed;
    try {
      parsed = JSON.parse(content);
    } catch (e) {
      parsed = undefined;
    }
    const validate = ajv.compile(weatherSchema);
    check(parsed !== undefined && validate(parsed), `json_schema reply: ${show(content)} ${show(validate.errors)}`);
  }
  const forced = await client.chat.completions.create({
    ...base, max_tokens: 64, messages: ask, tools, tool_choice: { type: 'function', function: { name: 'get_weather' } },
  });
  {
    const fc = forced.choices[0].message.tool_calls ?? [];
    const validate = ajv.compile(weatherSchema);
    let args;
    try {
      args = JSON.parse(fc[0]?.function?.arguments ?? '');
    } catch (e) {
      args = undefined;
    }
    check(fc.length >= 1 && fc[0].function.name === 'get_weather' && args !== undefined && validate(args)
          && forced.choices[0].finish_reason === 'tool_calls',
          `forced tool call: ${show(forced.choices[0])} ${show(validate.errors)}`);
    // n = 2 forced calls: every id unique.
    const pair = await client.chat.completions.create({
      ...base, temperature: 1, seed: 3, n: 2, max_tokens: 64, messages: ask, tools,
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
    });
    const ids = pair.choices.flatMap((c) => (c.message.tool_calls ?? []).map((t) => t.id));
    const again = (await client.chat.completions.create({
      ...base, max_tokens: 64, messages: ask, tools, tool_choice: { type: 'function', function: { name: 'get_weather' } },
    })).choices[0].message.tool_calls ?? [];
    ids.push(...again.map((t) => t.id));
    check(ids.length >= 3 && new Set(ids).size === ids.length, `tool-call ids unique: ${show(ids)}`);
  }
}

await runChecks('openai_sdk_check', main);
