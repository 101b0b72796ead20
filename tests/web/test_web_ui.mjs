// tests/web/test_web_ui.mjs: the chat page (coordinator/web/, docs/WEB.md)
// in Debian's real chromium, driven by playwright-core (pinned by
// package-lock.json; `make deps` runs npm ci). Run by
// tests/integration/test_web_ui.sh against `k3-coordinator web` on the tiny
// checkpoint with --local 2 and an API key:
//   K3_URL (http://127.0.0.1:P/), K3_API_KEY, K3_WORKERS (workers expected
//   in the cluster panel), K3_SHOTS (folder for the screenshots).
// Prints one "ok - ..." / "not ok - ..." line per check (tests/lib.sh's
// format) and exits 1 when any failed.
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';

const URL_ = process.env.K3_URL;
const KEY = process.env.K3_API_KEY || '';
const WORKERS = +(process.env.K3_WORKERS || 0);
const SHOTS = process.env.K3_SHOTS || 'build/screenshots';
mkdirSync(SHOTS, { recursive: true });

let failed = 0;
const t0 = Date.now();
const check = (cond, name, detail) => {
    const t = ((Date.now() - t0) / 1000).toFixed(1) + ' s';
    if (cond) console.log('ok - web: ' + name + ' (' + t + ')');
    else {
        failed++;
        console.log('not ok - web: ' + name + ' (' + t + ')' + (detail !== undefined ? ': ' + JSON.stringify(detail).slice(0, 400) : ''));
    }
    return cond;
};

const browser = await chromium.launch({
    executablePath: '/usr/bin/chromium',
    headless: true,
    // root in CI: chromium's sandbox needs an unprivileged user
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
const context = await browser.newContext({ viewport: { width: 1280, height: 800 }, colorScheme: 'light' });
const page = await context.newPage();
// generous: under ASan a stopped answer still runs on in the server (it
// cannot cancel yet) and holds the engine for a few seconds
page.setDefaultTimeout(60000);
const problems = [];
page.on('pageerror', (e) => problems.push('page error: ' + e.message));
page.on('console', (m) => {
    // chromium logs each failed fetch; those are judged by the listener below
    if (m.type() === 'error' && !/^Failed to load resource/.test(m.text())) problems.push('console: ' + m.text());
});
page.on('response', (r) => {
    // expected: the one 401 before the key is set; /metrics on a server
    // without it
    const u = new URL(r.url());
    if (r.status() >= 400 && r.status() !== 401 && !(u.pathname === '/metrics' && r.status() === 404))
        problems.push(r.status() + ' ' + u.pathname);
});

const input = page.locator('textarea#input');
const send = page.getByRole('button', { name: 'Send', exact: true });
const stop = page.getByRole('button', { name: 'Stop', exact: true });
const assistants = page.locator('[data-role="assistant"]');
const users = page.locator('[data-role="user"]');
const lastAnswer = () => assistants.last().locator('.msg-body');
const idle = () => send.waitFor({ state: 'visible' });
const setField = async (id, v) => {
    await page.fill('#' + id, String(v));
    await page.dispatchEvent('#' + id, 'change');
};
// page.waitForFunction compiles its predicate with eval inside the page,
// which the page's CSP (script-src 'self') rightly refuses: poll from here.
async function until(fn, arg, timeout = 60000) {
    const end = Date.now() + timeout;
    for (;;) {
        if (await page.evaluate(fn, arg)) return true;
        if (Date.now() > end) throw new Error('timed out waiting for ' + String(fn).slice(0, 200));
        await new Promise((r) => setTimeout(r, 50));
    }
}
async function openSettings() {
    if ((await page.getAttribute('#toggle-settings', 'aria-expanded')) !== 'true') await page.click('#toggle-settings');
}

try {
    const resp = await page.goto(URL_);
    const h = resp.headers();
    check(resp.status() === 200 && /text\/html/.test(h['content-type'] || ''), 'GET / is the page (text/html)', h);
    check(/script-src 'self'/.test(h['content-security-policy'] || ''), 'the page has a Content-Security-Policy', h);
    await until(() => document.getElementById('model-name').textContent !== 'connecting…');
    check(await input.evaluate((e) => e.tagName === 'TEXTAREA'), 'the message box is a textarea');

    // ---- the API key: refused without, stored in localStorage with ----
    if (KEY) {
        await input.fill('hello');
        await input.press('Enter');
        await page.locator('.msg-error').waitFor();
        const err = await page.locator('.msg-error').textContent();
        check(/API key/.test(err) && (await page.isVisible('#set-apikey')),
              'without the key: a message that asks for it, and the settings open', err);
        await setField('set-apikey', KEY);
        check((await page.evaluate(() => localStorage.getItem('k3.apiKey'))) === KEY, 'the key is kept in localStorage');
        await page.click('#new-chat');
    }

    // ---- send: Shift+Enter is a newline, Enter sends, the answer streams ----
    await openSettings();
    await page.screenshot({ path: SHOTS + '/web-settings.png' });
    await setField('set-temperature', 2);
    await setField('set-seed', 11);
    await setField('set-max_tokens', 24);
    await page.click('#panel-close');
    await input.click();
    await page.keyboard.insertText('Tell me about');
    await input.press('Shift+Enter');
    await page.keyboard.insertText('the quick brown fox.');
    check((await input.inputValue()) === 'Tell me about\nthe quick brown fox.' && (await users.count()) === 0,
          'Shift+Enter inserts a newline and sends nothing', await input.inputValue());
    await input.press('Enter');
    await users.first().waitFor();
    await idle();
    const a1 = await lastAnswer().textContent();
    check((await users.count()) === 1 && (await assistants.count()) === 1 && a1.length > 0 &&
          !(await lastAnswer().locator('.hint').count()),
          'Enter sends: one user and one streamed assistant message with text', a1);
    check((await users.first().locator('.msg-body').innerHTML()).includes('<br>'),
          'the user message keeps its line break');
    const st1 = await assistants.last().locator('.stats').textContent();
    check(/\d+ tokens/.test(st1) && /first token/.test(st1) && /prompt \d+/.test(st1),
          'per-answer stats: tokens, time to first token, prompt tokens', st1);

    // ---- a long answer, stopped with Stop while it streams ----
    await page.click('#new-chat');
    await openSettings();
    // at temperature 2, seed 4, this prompt runs 8048 tokens: ~10 s on an
    // idle machine, so Stop comes long before its end even under load
    await setField('set-seed', 4);
    await setField('set-max_tokens', 6000);
    await page.click('#panel-close');
    await input.fill('Write a long story.');
    await send.click();
    // one poll for both: text on the page and the Stop button still shown
    await until(() => {
        const b = [...document.querySelectorAll('[data-role="assistant"] .msg-body')].pop();
        return (b && b.textContent.length > 20) || document.getElementById('stop').hidden;
    });
    const partial = (await lastAnswer().textContent()).length;
    const streaming = await stop.isVisible();
    check(streaming && partial > 20, 'the answer is on the page while it still streams (Stop shown)', partial);
    // force: no actionability waits, the click lands at once (a trusted click)
    if (streaming) await stop.click({ force: true });
    await idle();
    const n1 = (await lastAnswer().textContent()).length;
    await page.waitForTimeout(800);
    const n2 = (await lastAnswer().textContent()).length;
    const st2 = await assistants.last().locator('.stats').textContent();
    const gotTokens = +((/≈(\d+) tokens/.exec(st2) || [])[1] || 0);
    check(n1 === n2 && n2 > 0 && gotTokens < 6000 && /stopped/.test(st2),
          'Stop ends the stream: the text stays, stops growing, marked stopped', { n1, n2, st2 });
    // the server sees the closed stream and cancels the generation
    // (docs/SERVING.md): /metrics counts it and /health has nothing running
    let cancelled = 0, running = -1;
    for (let i = 0; i < 100 && !(cancelled >= 1 && running === 0); i++) {
        const m = await (await fetch(URL_ + 'metrics')).text();
        cancelled = +((/^k3_requests_cancelled_total (\d+)/m.exec(m) || [])[1] || 0);
        running = (await (await fetch(URL_ + 'health')).json()).running;
        if (!(cancelled >= 1 && running === 0)) await new Promise((r) => setTimeout(r, 100));
    }
    check(cancelled >= 1 && running === 0, 'Stop cancels the generation on the server', { cancelled, running });
    // the tiny model's 24 tokens come in one read; this answer streamed for a while
    check(/≈\d+ tokens/.test(st2) && /[\d.]+ tok\/s/.test(st2),
          'a stopped answer: tokens counted from the stream, tok/s', st2);
    await page.screenshot({ path: SHOTS + '/web-stopped.png' });

    // ---- regenerate, with thinking on: a folded thought process ----
    await openSettings();
    await setField('set-max_tokens', 40);
    await setField('set-seed', 5);
    await page.check('#set-thinking');
    await page.dispatchEvent('#set-thinking', 'change');
    await page.click('#panel-close');
    await assistants.last().hover();
    await page.getByRole('button', { name: /Regenerate/ }).click();
    await stop.waitFor({ state: 'visible' }).catch(() => {});
    await idle();
    const st3 = await assistants.last().locator('.stats').textContent();
    const think = assistants.last().locator('details.thinking');
    check((await assistants.count()) === 1 && !/stopped/.test(st3) && /\d+ tokens/.test(st3),
          'regenerate replaces the last answer with a new one', st3);
    check((await think.count()) === 1 && !(await think.evaluate((d) => d.open)) &&
          (await think.locator('.think-body').textContent()).length > 0,
          'thinking on: the reasoning is in a folded block', await think.count());
    if (await think.count()) {
        await think.locator('summary').click();
        check(await think.evaluate((d) => d.open), 'the thinking block opens on click');
    }
    await openSettings();
    await page.uncheck('#set-thinking');
    await page.dispatchEvent('#set-thinking', 'change');
    await setField('set-max_tokens', 24);
    await page.click('#panel-close');

    // ---- edit a user turn and resend it ----
    await input.fill('A second question.');
    await input.press('Enter');
    await until(() => document.querySelectorAll('[data-role="user"]').length === 2);
    await idle();
    check((await users.count()) === 2 && (await assistants.count()) === 2, 'a second turn', await users.count());
    await users.first().hover();
    await users.first().getByRole('button', { name: /Edit/ }).click();
    await page.fill('.edit-box', 'An edited first question.');
    await page.getByRole('button', { name: 'Save & send' }).click();
    await until(() => document.querySelectorAll('[data-role="user"]').length === 1);
    await idle();
    check((await users.count()) === 1 && (await users.first().textContent()).includes('An edited first question.') &&
          (await assistants.count()) === 1 && /\d+ tokens/.test(await assistants.last().locator('.stats').textContent()),
          'edit: the turn is replaced, later turns dropped, a new answer', await users.allTextContents());

    // ---- reload: the conversations come back from localStorage ----
    await page.reload();
    await users.first().waitFor();
    const titles = await page.locator('#conv-list .conv-title').allTextContents();
    check((await users.first().textContent()).includes('An edited first question.') &&
          titles.some((t) => t.startsWith('An edited first question')) && titles.some((t) => t.startsWith('Tell me about')),
          'after a reload the conversation and the list (the edited title) are back', titles);
    await page.locator('#conv-list .conv-title', { hasText: 'Tell me about' }).click();
    check((await users.first().textContent()).includes('quick brown fox'), 'the sidebar opens an older conversation');

    // ---- model output with HTML renders as text (a scripted stream) ----
    // The tiny checkpoint's random weights cannot be steered to write
    // <script>, so this one answer comes from a stand-in for
    // /v1/chat/completions with the server's SSE shape; the page's
    // streaming and rendering code is the same.
    const evil = ['Here is **bold**, `code` and:\n\n<script>window.__pwned=1</script>\n',
                  '<img src=x onerror="window.__pwned=2">\n\n```html\n<b onclick=x>not bold</b>\n```\n',
                  '- one\n- two [link](javascript:alert(1))'];
    const sse = evil.map((t) => 'data: ' + JSON.stringify({ object: 'chat.completion.chunk',
        choices: [{ index: 0, delta: { content: t }, finish_reason: null }] }) + '\n\n').join('') +
        'data: ' + JSON.stringify({ choices: [{ index: 0, delta: {}, finish_reason: 'stop' }] }) + '\n\n' +
        'data: ' + JSON.stringify({ choices: [], usage: { prompt_tokens: 9, completion_tokens: 30,
            total_tokens: 39, prompt_tokens_details: { cached_tokens: 7 } } }) + '\n\ndata: [DONE]\n\n';
    await page.route('**/v1/chat/completions', (r) =>
        r.fulfill({ status: 200, headers: { 'Content-Type': 'text/event-stream' }, body: sse }));
    await page.click('#new-chat');
    await input.fill('Show me some <b>HTML</b>');
    await input.press('Enter');
    await idle();
    await page.unroute('**/v1/chat/completions');
    const body = lastAnswer();
    const txt = await body.textContent();
    check(txt.includes('<script>window.__pwned=1</script>') && txt.includes('<img src=x onerror="window.__pwned=2">'),
          '<script> and <img onerror> in model output show as text', txt);
    check((await body.locator('script, img, [onerror], [onclick]').count()) === 0 &&
          (await page.evaluate(() => window.__pwned)) === undefined,
          'no element and no script came from the model output');
    check((await body.locator('strong').count()) === 1 && (await body.locator('.code pre code').count()) === 1 &&
          (await body.locator('li').count()) === 2 && (await body.locator('a').count()) === 0,
          'Markdown: bold, a code block, a list; a javascript: link stays text');
    check((await users.last().textContent()).includes('<b>HTML</b>'), 'user text with HTML shows as text');
    check(/7 reused/.test(await assistants.last().locator('.stats').textContent()),
          'stats show the reused prompt tokens (usage.prompt_tokens_details.cached_tokens)');
    await page.screenshot({ path: SHOTS + '/web-chat.png' });

    // ---- the cluster panel ----
    await page.click('#toggle-cluster');
    await until((n) => document.querySelectorAll('#workers .worker').length === n, WORKERS);
    const cards = page.locator('#workers .worker');
    const texts = await cards.allTextContents();
    check(texts.length === WORKERS && texts.every((t, i) => t.includes('Worker ' + i) && /layers\d+–\d+/.test(t)),
          `the cluster panel lists every worker (${WORKERS}) with its layer range`, texts);
    check(texts.every((t) => /expert cache hits/.test(t) && /NUMA node/.test(t) && /busy share/.test(t)),
          'each worker shows NUMA node, drive, busy share, expert-cache hit rate');
    const before = await page.textContent('#cluster-updated');
    await until((b) => document.getElementById('cluster-updated').textContent !== b, before, 5000)
        .catch(() => {});
    check((await page.textContent('#cluster-updated')) !== before, 'the cluster panel refreshes by itself');
    await page.screenshot({ path: SHOTS + '/web-cluster.png' });
    await page.locator('#totals-box').waitFor();
    const totals = await page.textContent('#cluster-totals');
    check(/decode tok\/s/.test(totals) && /requests/.test(totals) && /cancelled/.test(totals) &&
          /[\d.]+ smean first token/.test(totals),
          'the cluster panel shows the server totals from /metrics', totals);
    await page.locator('#totals-box').scrollIntoViewIfNeeded();
    await page.screenshot({ path: SHOTS + '/web-cluster-totals.png' });
    await page.emulateMedia({ colorScheme: 'dark' });
    await page.screenshot({ path: SHOTS + '/web-cluster-dark.png' });

    check(problems.length === 0, 'no page errors, no console errors (CSP included)', problems);
} catch (e) {
    check(false, 'the browser session ran to its end', String(e && e.stack || e));
    await page.screenshot({ path: SHOTS + '/web-failure.png' }).catch(() => {});
} finally {
    await browser.close();
}
process.exit(failed ? 1 : 0);
