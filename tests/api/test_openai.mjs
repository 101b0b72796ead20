// tests/api/test_openai.mjs: the OpenAI API of `k3-coordinator serve`
// (docs/SERVING.md) through the official `openai` npm client, pinned by
// tests/api/package-lock.json. Run by tests/integration/test_serve.sh,
// which starts the server on the tiny checkpoint and passes:
//   K3_URL       http://127.0.0.1:PORT/v1
//   K3_API_KEY   the server's --api-key
//   K3_MODEL_ID  the id /v1/models must list
//   K3_CTX       the server's --ctx
//   K3_PROMPT    a raw prompt, and K3_NGEN, K3_CLI_TEXT: the text
//                `k3-coordinator --local 0 --ngen K3_NGEN "K3_PROMPT"` printed
// Prints one "ok - ..." / "not ok - ..." line per check.
import OpenAI from 'openai';

const env = process.env;
const client = new OpenAI({ baseURL: env.K3_URL, apiKey: env.K3_API_KEY, maxRetries: 0 });
const model = env.K3_MODEL_ID;
let failed = 0;

function check(cond, msg, detail) {
    if (cond) {
        console.log(`ok - ${msg}`);
    } else {
        failed++;
        console.log(`not ok - ${msg}`);
        if (detail !== undefined) console.log(`# ${JSON.stringify(detail).slice(0, 600)}`);
    }
}

const user = (text) => [{ role: 'user', content: text }];

async function chat(messages, opts = {}) {
    return client.chat.completions.create({ model, messages, ...opts });
}

// Reads a chat stream into {text, chunks, finish, usage, first}.
async function chatStream(messages, opts = {}) {
    const stream = await client.chat.completions.create({ model, messages, stream: true, ...opts });
    const out = { text: '', reasoning: '', chunks: [], finish: null, usage: null };
    for await (const ch of stream) {
        out.chunks.push(ch);
        if (ch.usage) out.usage = ch.usage;
        for (const c of ch.choices) {
            if (c.delta.content) out.text += c.delta.content;
            if (c.delta.reasoning_content) out.reasoning += c.delta.reasoning_content;
            if (c.finish_reason) out.finish = c.finish_reason;
        }
    }
    return out;
}

async function completionStream(prompt, opts = {}) {
    const stream = await client.completions.create({ model, prompt, stream: true, ...opts });
    let text = '', finish = null;
    for await (const ch of stream) {
        for (const c of ch.choices) {
            text += c.text;
            if (c.finish_reason) finish = c.finish_reason;
        }
    }
    return { text, finish };
}

async function main() {
    // models
    const models = await client.models.list();
    check(models.data.some((m) => m.id === model), `models list has ${model}`, models.data);
    const one = await client.models.retrieve(model);
    check(one.id === model && one.object === 'model', 'models retrieve', one);

    // chat, non-stream. The tiny checkpoint's weights are random: greedy
    // chat answers are hidden markers only (empty content), so the checks
    // of text use temperature 2 with a fixed seed, which is as reproducible
    // (coordinator/sampler.h) and gives visible text.
    const msgs = user('Tell me about the quick brown fox.');
    const S = { temperature: 2, seed: 11 };
    const g1 = await chat(msgs, { temperature: 0, max_tokens: 24 });
    const g2 = await chat(msgs, { temperature: 0, max_tokens: 24 });
    check(g1.choices[0].message.content === g2.choices[0].message.content &&
          g1.usage.completion_tokens === g2.usage.completion_tokens &&
          g1.choices[0].finish_reason === g2.choices[0].finish_reason,
          'temperature 0 twice gives the same answer', [g1.choices[0], g2.choices[0]]);
    const a = await chat(msgs, { ...S, max_tokens: 24 });
    const ma = a.choices[0].message;
    check(a.object === 'chat.completion' && ma.role === 'assistant' &&
          typeof ma.content === 'string', 'chat non-stream shape', a);
    check(a.usage.prompt_tokens > 0 && a.usage.completion_tokens >= 1 &&
          a.usage.total_tokens === a.usage.prompt_tokens + a.usage.completion_tokens,
          'chat non-stream usage', a.usage);
    check(['stop', 'length'].includes(a.choices[0].finish_reason), 'chat finish_reason',
          a.choices[0]);
    check(ma.content.length > 0, 'chat at temperature 2 gives visible text', ma);

    // the same seed at temperature 1 twice: the same sample
    const s1 = await chat(msgs, { ...S, max_tokens: 24 });
    check(s1.choices[0].message.content === ma.content, 'same seed, same sample',
          [s1.choices[0].message.content, ma.content]);
    const s2 = await chat(msgs, { temperature: 2, seed: 12, max_tokens: 24 });
    check(s2.choices[0].message.content !== ma.content, 'another seed, another sample',
          [s2.choices[0].message.content, ma.content]);

    // stream with include_usage
    const st = await chatStream(msgs, { ...S, max_tokens: 24,
                                        stream_options: { include_usage: true } });
    const first = st.chunks[0];
    check(first && first.object === 'chat.completion.chunk' &&
          first.choices[0].delta.role === 'assistant', 'stream opens with the role delta', first);
    check(st.text === ma.content, 'stream deltas concatenated equal the non-stream text',
          [st.text, ma.content]);
    check(st.finish === a.choices[0].finish_reason, 'stream finish_reason equals non-stream',
          [st.finish, a.choices[0].finish_reason]);
    const last = st.chunks[st.chunks.length - 1];
    check(last && last.choices.length === 0 && last.usage &&
          last.usage.completion_tokens === a.usage.completion_tokens &&
          last.usage.prompt_tokens === a.usage.prompt_tokens,
          'include_usage: a last chunk with empty choices and the usage', last);
    check(st.chunks.slice(0, -1).every((c) => c.usage === null),
          'include_usage: usage is null on the other chunks');
    const nou = await chatStream(msgs, { ...S, max_tokens: 4 });
    check(nou.usage === null && nou.chunks.every((c) => c.choices.length === 1),
          'no usage chunk without include_usage');

    // max_tokens -> length
    const l = await chat(msgs, { ...S, max_tokens: 3 });
    check(l.choices[0].finish_reason === 'length' && l.usage.completion_tokens === 3,
          'max_tokens 3 gives finish_reason length and 3 tokens', l);
    const lc = await chat(msgs, { ...S, max_completion_tokens: 3 });
    check(lc.usage.completion_tokens === 3, 'max_completion_tokens is honoured', lc.usage);

    // stop strings: cut before the first match, finish_reason stop
    const long = await chat(msgs, { ...S, max_tokens: 48 });
    const full = long.choices[0].message.content;
    // a stop string of three ASCII letters after the first character (a
    // slice of the UTF-16 string could split a surrogate pair)
    const at = full.slice(1).search(/[a-z]{3}/) + 1;
    if (at > 0) {
        const stop = full.slice(at, at + 3);
        const want = full.slice(0, full.indexOf(stop));
        const cut = await chat(msgs, { ...S, max_tokens: 48, stop });
        check(cut.choices[0].message.content === want && cut.choices[0].finish_reason === 'stop',
              `stop ${JSON.stringify(stop)} cuts the text, finish_reason stop`,
              [cut.choices[0], want]);
        const cs = await chatStream(msgs, { ...S, max_tokens: 48, stop: ['\u0001', stop] });
        check(cs.text === want && cs.finish === 'stop' && !cs.text.includes(stop),
              'stop in a stream: held back across chunks, never emitted', [cs.text, want]);
    } else {
        check(false, 'the 48-token answer has three ASCII letters to stop at', full);
    }

    // completions at temperature 0 equal the CLI
    const ngen = Number(env.K3_NGEN);
    const c = await client.completions.create({ model, prompt: env.K3_PROMPT, temperature: 0,
                                                max_tokens: ngen });
    check(c.object === 'text_completion' && c.choices[0].text === env.K3_CLI_TEXT,
          '/v1/completions at temperature 0 equals the CLI text', [c.choices[0].text, env.K3_CLI_TEXT]);
    const cst = await completionStream(env.K3_PROMPT, { temperature: 0, max_tokens: ngen });
    check(cst.text === c.choices[0].text && cst.finish === c.choices[0].finish_reason,
          '/v1/completions stream equals non-stream', [cst.text, c.choices[0].text]);

    // two concurrent streams each equal their sequential result
    const m1 = user('One fish, two fish.'), m2 = user('Red fish, blue fish, and more fish.');
    const q1 = await chatStream(m1, { ...S, max_tokens: 20 });
    const q2 = await chatStream(m2, { ...S, max_tokens: 20 });
    const [p1, p2] = await Promise.all([chatStream(m1, { ...S, max_tokens: 20 }),
                                        chatStream(m2, { ...S, max_tokens: 20 })]);
    check(p1.text === q1.text && p2.text === q2.text,
          'two concurrent streams equal their sequential results', [p1.text, q1.text, p2.text, q2.text]);
    // four concurrent completion streams (seeded sampling, 40 tokens) each equal their own
    // sequential result: the steps of the four interleave on the trunk
    const four = ['alpha beta gamma', 'one two three four five', 'The lazy dog', 'Once upon'];
    const fopt = { temperature: 0.9, seed: 11, max_tokens: 40 };
    const fseq = [];
    for (const p of four) fseq.push(await completionStream(p, fopt));
    const fpar = await Promise.all(four.map((p) => completionStream(p, fopt)));
    check(fpar.every((r, i) => r.text === fseq[i].text && r.text.length > 0),
          'four concurrent streams equal their sequential results',
          fpar.map((r, i) => [r.text, fseq[i].text]));

    // messages: system/developer/assistant history, text-part arrays
    const hist = await chat([{ role: 'system', content: 'Be brief.' },
                             { role: 'developer', content: 'Answer in English.' },
                             { role: 'user', content: [{ type: 'text', text: 'Hello ' },
                                                       { type: 'text', text: 'there.' }] },
                             { role: 'assistant', content: 'Hi.' },
                             { role: 'user', content: 'And now?' }],
                            { ...S, max_tokens: 4 });
    check(hist.usage.completion_tokens >= 1, 'multi-turn chat with text parts', hist.usage);
    const parts = await chat(user([{ type: 'text', text: 'Tell me about the quick ' },
                                   { type: 'text', text: 'brown fox.' }]),
                             { ...S, max_tokens: 24 });
    check(parts.choices[0].message.content === ma.content,
          'text parts are joined like one string', [parts.choices[0].message.content, ma.content]);

    // thinking: the think channel comes back as reasoning_content (the
    // tiny model never opens the response channel, so all of it is
    // reasoning); reasoning_effort other than none turns it on too
    const th = await chat(msgs, { ...S, max_tokens: 24, enable_thinking: true });
    const thm = th.choices[0].message;
    check((thm.reasoning_content || '').length > 0 && thm.content === '',
          'enable_thinking: the answer is reasoning_content', thm);
    const ths = await chatStream(msgs, { ...S, max_tokens: 24, enable_thinking: true });
    check(ths.reasoning === thm.reasoning_content && ths.text === thm.content,
          'thinking stream: reasoning_content deltas equal the non-stream reasoning',
          [ths.reasoning, thm.reasoning_content]);
    const eff = await chat(msgs, { ...S, max_tokens: 24, reasoning_effort: 'low' });
    check(eff.choices[0].message.reasoning_content === thm.reasoning_content,
          'reasoning_effort low turns thinking on', eff.choices[0].message);
    const effn = await chat(msgs, { ...S, max_tokens: 24, reasoning_effort: 'none' });
    check(effn.choices[0].message.content === ma.content &&
          effn.choices[0].message.reasoning_content === undefined,
          'reasoning_effort none leaves thinking off', effn.choices[0].message);

    // tools: declaration, an assistant call and its result render
    const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather.',
                     parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];
    const conv = [{ role: 'user', content: 'Weather in Paris?' },
                  { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function',
                    function: { name: 'get_weather', arguments: '{"city":"Paris"}' } }] },
                  { role: 'tool', tool_call_id: 'call_1', content: 'sunny' }];
    const t0 = await chat(conv, { ...S, max_tokens: 2 });
    const t1 = await chat(conv, { ...S, max_tokens: 2, tools });
    const t2 = await chat(conv, { ...S, max_tokens: 2, tools, tool_choice: 'required' });
    const t3 = await chat(conv, { ...S, max_tokens: 2, tools, tool_choice: 'none' });
    check(t1.usage.prompt_tokens > t0.usage.prompt_tokens &&
          t2.usage.prompt_tokens > t1.usage.prompt_tokens &&
          t3.usage.prompt_tokens === t0.usage.prompt_tokens,
          'tools: declared (longer prompt), required adds the tool-choice message, none omits them',
          [t0.usage, t1.usage, t2.usage, t3.usage]);
    const forced = await chat(conv, { ...S, max_tokens: 2, tools,
                                      tool_choice: { type: 'function', function: { name: 'get_weather' } } });
    check(forced.usage.prompt_tokens > t1.usage.prompt_tokens, 'tools: a forced function renders',
          forced.usage);
    for (const [name, body, param] of [
        ['tool arguments that are not JSON', { messages: [{ role: 'assistant', content: '',
          tool_calls: [{ id: 'c', type: 'function', function: { name: 'f', arguments: 'not json' } }] }] },
         'messages'],
        ['tool_choice without tools', { messages: msgs, tool_choice: 'required' }, 'tool_choice'],
        ['a forced tool that is not declared', { messages: msgs, tools,
          tool_choice: { type: 'function', function: { name: 'nope' } } }, 'messages'],
        ['tool_calls on a user message', { messages: [{ role: 'user', content: 'x',
          tool_calls: [] }] }, 'messages[0].tool_calls']]) {
        try {
            await client.chat.completions.create({ model, max_tokens: 2, ...body });
            check(false, `${name} is refused`);
        } catch (e) {
            check(e.status === 400 && e.param === param, `${name}: 400 naming ${param}`,
                  { status: e.status, param: e.param, message: e.message });
        }
    }

    // errors through the client: the envelope fields
    try {
        await chat(msgs, { n: 2 });
        check(false, 'n = 2 is refused');
    } catch (e) {
        check(e.status === 400 && e.param === 'n' && e.code === 'unsupported_parameter',
              'n = 2: 400 naming n', { status: e.status, param: e.param, code: e.code });
    }
    const ctx = Number(env.K3_CTX);
    try {
        await chat(user('fox '.repeat(ctx * 2)), { stream: true });
        check(false, 'a prompt over the context is refused');
    } catch (e) {
        check(e.status === 400 && e.code === 'context_length_exceeded',
              'prompt over the context: 400 context_length_exceeded before any SSE',
              { status: e.status, code: e.code, message: e.message });
    }
    // max_tokens beyond the room left is clamped: prompt + completion = ctx
    const big = await client.completions.create({ model, prompt: 'fox', temperature: 0,
                                                  max_tokens: 100000 });
    check(big.usage.prompt_tokens + big.usage.completion_tokens <= ctx &&
          (big.choices[0].finish_reason === 'stop' ||
           big.usage.prompt_tokens + big.usage.completion_tokens === ctx),
          'max_tokens is clamped to the room left in the context', big.usage);

    const bad = new OpenAI({ baseURL: env.K3_URL, apiKey: 'wrong-key', maxRetries: 0 });
    try {
        await bad.models.list();
        check(false, 'a wrong API key is refused');
    } catch (e) {
        check(e.status === 401, 'wrong API key: 401 through the client', { status: e.status });
    }
}

main().then(() => process.exit(failed ? 1 : 0), (e) => {
    console.log(`not ok - test_openai.mjs threw: ${e && e.stack ? e.stack : e}`);
    process.exit(1);
});
