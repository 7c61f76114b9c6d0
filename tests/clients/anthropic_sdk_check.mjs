// The official Anthropic TypeScript SDK (@anthropic-ai/sdk, pinned in package.json) against a
// running `m3 serve`: messages.create whole and streamed (raw events, and the SDK's
// messages.stream() helper with finalMessage()), thinking, a stop sequence, tools with a tool_use
// -> tool_result round trip, count_tokens, and errors as the SDK's classes (BadRequestError,
// AuthenticationError, NotFoundError). Exits non-zero on any failure.
// Usage: node anthropic_sdk_check.mjs BASE_URL API_KEY   (driver: tests/node_client_check.py)
import Anthropic from '@anthropic-ai/sdk';
import { check, expectError, failures, runChecks, serverArgs, show } from './check_util.mjs';

const [baseURL, apiKey] = serverArgs('anthropic_sdk_check.mjs');
const client = new Anthropic({ baseURL, apiKey, maxRetries: 0, timeout: 120_000 });
const textOf = (message) => message.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

const hello = [{ role: 'user', content: 'Hello! Who are you?' }];
const base = { model: 'tiny', max_tokens: 10, temperature: 0, messages: hello };
const thinking = { ...base, thinking: { type: 'enabled', budget_tokens: 1024 } };

async function main() {
  // Whole replies, thinking on and off.
  await client.messages.create({ ...thinking, max_tokens: 1 }); // caches the prompt for the compares
  const whole = await client.messages.create(thinking);
  check(whole.type === 'message' && whole.role === 'assistant' && whole.id.startsWith('msg_'), `whole: ${show(whole)}`);
  check(whole.content[0]?.type === 'thinking' && typeof whole.content[0].thinking === 'string',
        `thinking first: ${show(whole.content)}`);
  check(whole.stop_reason === 'max_tokens' && whole.usage.output_tokens === 10, `stop/usage: ${show(whole)}`);

  // Streamed with the SDK's helper: its events and its assembled message match the whole reply.
  let streamedText = '';
  let streamedThinking = '';
  const stream = client.messages.stream(thinking);
  stream.on('text', (delta) => { streamedText += delta; });
  stream.on('thinking', (delta) => { streamedThinking += delta; });
  const final = await stream.finalMessage();
  check(JSON.stringify(final.content) === JSON.stringify(whole.content),
        `stream helper == whole: ${show(final.content)} vs ${show(whole.content)}`);
  check(streamedThinking === whole.content[0].thinking && streamedText === textOf(whole),
        `stream helper deltas: ${show(streamedThinking)} ${show(streamedText)}`);
  check(final.stop_reason === 'max_tokens' && final.usage.output_tokens === 10
        && final.usage.input_tokens + final.usage.cache_read_input_tokens
           === whole.usage.input_tokens + whole.usage.cache_read_input_tokens,
        `stream helper usage: ${show(final.usage)} vs ${show(whole.usage)}`);

  const plain = await client.messages.create({ ...base, system: [{ type: 'text', text: 'Be brief.' }] });
  check(plain.content.every((b) => b.type === 'text'), `thinking off: ${show(plain.content)}`);

  // Streamed raw: Anthropic's event order.
  const raw = await client.messages.create({ ...thinking, stream: true });
  const names = [];
  for await (const event of raw) names.push(event.type);
  check(names[0] === 'message_start' && names.at(-2) === 'message_delta' && names.at(-1) === 'message_stop'
        && names.includes('content_block_start') && names.includes('content_block_delta')
        && names.filter((n) => n === 'content_block_start').length === names.filter((n) => n === 'content_block_stop').length,
        `raw events: ${names.join(' ')}`);

  // A stop sequence: the text is cut before it and the reply names it.
  const text = textOf(plain);
  if (text.length >= 4) {
    const stop = text.slice(2, 4);
    const cut = await client.messages.create({ ...base, system: [{ type: 'text', text: 'Be brief.' }],
                                               stop_sequences: [stop] });
    check(cut.stop_reason === 'stop_sequence' && cut.stop_sequence === stop && textOf(cut) === text.slice(0, text.indexOf(stop)),
          `stop sequence ${show(stop)}: ${show(cut)}`);
  } else {
    failures.push(`the greedy text is too short for a stop sequence: ${show(text)}`);
  }

  // count_tokens: the prompt the reply counted.
  const counted = await client.messages.countTokens({ model: 'tiny', messages: hello, thinking: thinking.thinking });
  check(counted.input_tokens === whole.usage.input_tokens + whole.usage.cache_read_input_tokens,
        `count_tokens: ${show(counted)} vs ${show(whole.usage)}`);

  // Tools: offered freely (the tiny model writes no call of its own), then forced (tool_choice
  // any: the model must call get_weather); the calls go back with their tool_results and the
  // conversation goes on.
  const tools = [{
    name: 'get_weather',
    description: 'Weather of a city',
    input_schema: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  }];
  const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const free = await client.messages.create({ ...base, tools, tool_choice: { type: 'auto' }, messages: ask });
  check(['end_turn', 'max_tokens', 'tool_use'].includes(free.stop_reason), `tools: ${show(free)}`);
  const first = await client.messages.create({ ...base, max_tokens: 60, tools, tool_choice: { type: 'any' }, messages: ask });
  const calls = first.content.filter((b) => b.type === 'tool_use');
  check(first.stop_reason === 'tool_use' && calls.length > 0, `forced tool call: ${show(first)}`);
  for (const c of calls) {
    check(c.id.startsWith('toolu_') && c.name === 'get_weather' && typeof c.input === 'object', `tool_use: ${show(c)}`);
  }
  const assistant = first.content;
  const streamedFirst = await client.messages.stream({ ...base, max_tokens: 60, tools, tool_choice: { type: 'any' },
                                                       messages: ask }).finalMessage();
  check(JSON.stringify(streamedFirst.content.map((b) => [b.type, b.name, b.input]))
        === JSON.stringify(first.content.map((b) => [b.type, b.name, b.input])) && streamedFirst.stop_reason === 'tool_use',
        `forced call streamed == whole: ${show(streamedFirst)} vs ${show(first)}`);
  const results = calls.map((c) => ({ type: 'tool_result', tool_use_id: c.id, content: 'Rain, 12 C' }));
  const second = await client.messages.create({
    ...base, tools, messages: [...ask, { role: 'assistant', content: assistant }, { role: 'user', content: results }],
  });
  check(second.type === 'message' && ['end_turn', 'max_tokens', 'tool_use'].includes(second.stop_reason),
        `after tool_result: ${show(second)}`);
  const streamedSecond = await client.messages.stream({
    ...base, tools, messages: [...ask, { role: 'assistant', content: assistant }, { role: 'user', content: results }],
  }).finalMessage();
  check(JSON.stringify(streamedSecond.content) === JSON.stringify(second.content),
        `tool round trip streamed == whole: ${show(streamedSecond.content)} vs ${show(second.content)}`);

  // Errors as the SDK's classes, with Anthropic's error body.
  const bad = await expectError('an image block', Anthropic.BadRequestError, () => client.messages.create({
    ...base,
    messages: [{ role: 'user', content: [{ type: 'image', source: { type: 'base64', media_type: 'image/png', data: 'AAAA' } }] }],
  }));
  check(bad?.status === 400 && bad?.error?.type === 'error' && bad?.error?.error?.type === 'invalid_request_error'
        && /image/.test(bad?.error?.error?.message ?? ''), `BadRequestError body: ${show(bad?.error)}`);
  await expectError('a tool_result without its call', Anthropic.BadRequestError, () => client.messages.create({
    ...base, messages: [{ role: 'user', content: [{ type: 'tool_result', tool_use_id: 'toolu_x', content: 'x' }] }],
  }));
  await expectError('a server tool', Anthropic.BadRequestError, () => client.messages.create({
    ...base, tools: [{ type: 'web_search_20250305', name: 'web_search' }],
  }));
  await expectError('a streamed bad request', Anthropic.BadRequestError, async () => {
    const s = client.messages.stream({ ...base, max_tokens: 0 });
    await s.finalMessage();
  });
  const wrongKey = new Anthropic({ baseURL, apiKey: 'wrong', maxRetries: 0 });
  const auth = await expectError('a wrong key', Anthropic.AuthenticationError, () => wrongKey.messages.create(base));
  check(auth?.status === 401 && auth?.error?.error?.type === 'authentication_error', `401 body: ${show(auth?.error)}`);
  await expectError('count_tokens with max_tokens', Anthropic.BadRequestError,
                    () => client.messages.countTokens({ model: 'tiny', messages: hello, max_tokens: 3 }));
  const notFound = await expectError('an unknown route', Anthropic.NotFoundError,
                                     () => client.get('/v1/nothing-here'));
  check(notFound?.status === 404, `404: ${show(notFound?.error)}`);
}

await runChecks('anthropic_sdk_check', main);
