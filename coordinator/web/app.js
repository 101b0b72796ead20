// coordinator/web/app.js: the chat page's logic (docs/WEB.md). A plain
// client of the server it was loaded from: POST /v1/chat/completions with
// stream:true (SSE read through fetch + ReadableStream), GET /health and
// /metrics for the cluster panel. Owns the page's state: conversations,
// settings and the API key in localStorage (keys below). Model and user text
// reach the DOM only through K3md.render (escapes first) or textContent.
'use strict';
(function () {
    const $ = (id) => document.getElementById(id);
    const LS = { convs: 'k3.conversations', current: 'k3.current', settings: 'k3.settings', key: 'k3.apiKey' };
    const DEFAULTS = { system: '', temperature: 0.7, top_p: 1, max_tokens: '', seed: '', thinking: false };
    const REFRESH_MS = 2000;

    // ---- state -------------------------------------------------------------
    const load = (k, d) => {
        try {
            const v = JSON.parse(localStorage.getItem(k));
            return v == null ? d : v;
        } catch (e) {
            return d;
        }
    };
    const save = (k, v) => {
        try {
            localStorage.setItem(k, JSON.stringify(v));
        } catch (e) {
            showBanner('Could not save to this browser\'s storage: ' + e.message);
        }
    };
    let convs = load(LS.convs, []); // [{id, title, updated, messages:[{role, content, reasoning, stats}]}]
    if (!Array.isArray(convs)) convs = [];
    let currentId = load(LS.current, null);
    let settings = Object.assign({}, DEFAULTS, load(LS.settings, {}));
    let apiKey = localStorage.getItem(LS.key) || '';
    let modelId = null;
    let busy = null; // {controller, conv, msg, el} while an answer streams

    const current = () => convs.find((c) => c.id === currentId) || null;
    const persist = () => {
        convs.sort((a, b) => b.updated - a.updated);
        save(LS.convs, convs);
        save(LS.current, currentId);
    };
    const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
    const authHeaders = () => (apiKey ? { Authorization: 'Bearer ' + apiKey } : {});

    // ---- banner ------------------------------------------------------------
    function showBanner(text, kind) {
        const b = $('banner');
        b.textContent = text;
        b.className = 'banner ' + (kind || 'error');
        b.hidden = false;
    }
    const hideBanner = () => ($('banner').hidden = true);

    // ---- sidebar -----------------------------------------------------------
    function renderList() {
        const ul = $('conv-list');
        ul.textContent = '';
        if (!convs.length) {
            const li = document.createElement('li');
            li.className = 'hint';
            li.textContent = 'No conversations yet';
            ul.appendChild(li);
        }
        for (const c of convs) {
            const li = document.createElement('li');
            li.className = 'conv' + (c.id === currentId ? ' active' : '');
            li.dataset.id = c.id;
            const t = document.createElement('button');
            t.type = 'button';
            t.className = 'conv-title';
            t.textContent = c.title || 'New conversation';
            t.title = c.title || '';
            t.onclick = () => switchTo(c.id);
            const del = document.createElement('button');
            del.type = 'button';
            del.className = 'conv-del';
            del.setAttribute('aria-label', 'Delete conversation');
            del.title = 'Delete';
            del.textContent = '×';
            del.onclick = () => removeConv(c.id);
            li.append(t, del);
            ul.appendChild(li);
        }
    }

    function switchTo(id) {
        if (busy) stopAnswer();
        currentId = id;
        persist();
        renderList();
        renderMessages();
        $('input').focus();
    }

    function removeConv(id) {
        if (busy && busy.conv.id === id) stopAnswer();
        convs = convs.filter((c) => c.id !== id);
        if (currentId === id) currentId = null;
        persist();
        renderList();
        renderMessages();
    }

    // ---- messages ----------------------------------------------------------
    function fmtStats(s) {
        if (!s) return '';
        const parts = [];
        if (s.completion_tokens != null) parts.push((s.estimated ? '≈' : '') + s.completion_tokens + ' tokens');
        if (s.tps) parts.push(s.tps.toFixed(1) + ' tok/s');
        if (s.ttft_s != null) parts.push('first token ' + s.ttft_s.toFixed(2) + ' s');
        if (s.prompt_tokens != null) {
            let p = 'prompt ' + s.prompt_tokens;
            if (s.cached_tokens != null) p += ' (' + s.cached_tokens + ' reused)';
            parts.push(p);
        }
        if (s.total_s != null) parts.push(s.total_s.toFixed(1) + ' s');
        if (s.finish === 'length') parts.push('max tokens reached');
        else if (s.finish === 'stopped') parts.push('stopped');
        else if (s.finish && s.finish !== 'stop') parts.push(s.finish);
        return parts.join(' · ');
    }

    function button(label, title, onclick) {
        const b = document.createElement('button');
        b.type = 'button';
        b.className = 'act';
        b.textContent = label;
        b.title = title;
        b.onclick = onclick;
        return b;
    }

    // One message's element; returns it (also used to refresh while streaming).
    function messageEl(conv, i) {
        const m = conv.messages[i];
        const el = document.createElement('article');
        el.className = 'msg ' + m.role;
        el.dataset.role = m.role;
        el.dataset.index = i;
        const head = document.createElement('div');
        head.className = 'msg-head';
        head.textContent = m.role === 'user' ? 'You' : (modelId || 'Assistant');
        el.appendChild(head);
        if (m.role === 'assistant' && (m.reasoning || (busy && busy.msg === m && settings.thinking))) {
            const d = document.createElement('details');
            d.className = 'thinking';
            d.open = !!m.thinkOpen;
            d.ontoggle = () => (m.thinkOpen = d.open);
            const s = document.createElement('summary');
            s.textContent = busy && busy.msg === m && !m.content ? 'Thinking…' : 'Thought process';
            const body = document.createElement('div');
            body.className = 'think-body';
            body.textContent = m.reasoning || '';
            d.append(s, body);
            el.appendChild(d);
        }
        const body = document.createElement('div');
        body.className = 'msg-body';
        body.innerHTML = K3md.render(m.content); // escaped, then formatted
        if (m.role === 'assistant' && !m.content && !m.reasoning) {
            if (busy && busy.msg === m)
                body.innerHTML = '<span class="typing" aria-label="waiting for the first token"><i></i><i></i><i></i></span>';
            else if (!m.error)
                body.innerHTML = m.stats && m.stats.finish === 'stopped'
                    ? '<span class="hint">(stopped before the first token)</span>'
                    : '<span class="hint">(no visible text: the model ended its answer at once)</span>';
        }
        el.appendChild(body);
        if (m.error) {
            const e = document.createElement('div');
            e.className = 'msg-error';
            e.textContent = m.error;
            el.appendChild(e);
        }
        const foot = document.createElement('div');
        foot.className = 'msg-foot';
        if (m.role === 'assistant') {
            const st = document.createElement('span');
            st.className = 'stats';
            st.textContent = fmtStats(m.stats);
            foot.appendChild(st);
            if (!busy && i === conv.messages.length - 1)
                foot.appendChild(button('↻ Regenerate', 'Answer this question again', () => regenerate(conv)));
            foot.appendChild(button('Copy', 'Copy the answer', () => copyText(m.content)));
        } else if (!busy) {
            foot.appendChild(button('✎ Edit', 'Edit this message and send it again', () => editTurn(conv, i, el)));
        }
        el.appendChild(foot);
        return el;
    }

    function renderMessages() {
        const box = $('messages');
        box.querySelectorAll('.msg').forEach((n) => n.remove());
        const conv = current();
        $('empty').hidden = !!(conv && conv.messages.length);
        if (!conv) return;
        conv.messages.forEach((m, i) => box.appendChild(messageEl(conv, i)));
        box.scrollTop = box.scrollHeight;
    }

    // Re-renders the streaming message in place (cheap enough at token rate).
    function refreshStreaming() {
        if (!busy || busy.conv.id !== currentId) return;
        const box = $('messages');
        const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
        const i = busy.conv.messages.indexOf(busy.msg);
        const fresh = messageEl(busy.conv, i);
        if (busy.el && busy.el.isConnected) busy.el.replaceWith(fresh);
        else box.appendChild(fresh);
        busy.el = fresh;
        if (atBottom) box.scrollTop = box.scrollHeight;
    }

    function copyText(t) {
        if (navigator.clipboard) navigator.clipboard.writeText(t).catch(() => {});
    }

    function editTurn(conv, i, el) {
        const m = conv.messages[i];
        const body = el.querySelector('.msg-body');
        const foot = el.querySelector('.msg-foot');
        const ta = document.createElement('textarea');
        ta.className = 'edit-box';
        ta.value = m.content;
        ta.setAttribute('aria-label', 'Edit message');
        body.replaceWith(ta);
        foot.textContent = '';
        const go = () => {
            const text = ta.value.trim();
            if (!text) return;
            conv.messages = conv.messages.slice(0, i);
            if (i === 0) conv.title = '';
            send(text, conv);
        };
        ta.addEventListener('keydown', (e) => {
            if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
                e.preventDefault();
                go();
            } else if (e.key === 'Escape') renderMessages();
        });
        foot.append(button('Save & send', 'Replace this message and everything after it', go),
                    button('Cancel', 'Keep the message as it was', renderMessages));
        ta.focus();
        ta.setSelectionRange(ta.value.length, ta.value.length);
    }

    function regenerate(conv) {
        if (busy) return;
        const last = conv.messages[conv.messages.length - 1];
        if (!last || last.role !== 'assistant') return;
        conv.messages.pop();
        stream(conv);
    }

    // ---- sending and streaming -----------------------------------------------
    function send(text, conv) {
        if (busy) return;
        if (!conv) {
            conv = { id: newId(), title: '', updated: Date.now(), messages: [] };
            convs.unshift(conv);
            currentId = conv.id;
        }
        if (!conv.title) conv.title = text.replace(/\s+/g, ' ').slice(0, 60);
        conv.messages.push({ role: 'user', content: text });
        stream(conv);
    }

    function requestBody(conv) {
        const msgs = [];
        if (settings.system.trim()) msgs.push({ role: 'system', content: settings.system });
        for (const m of conv.messages) {
            const o = { role: m.role, content: m.content };
            if (m.role === 'assistant' && m.reasoning) o.reasoning_content = m.reasoning;
            msgs.push(o);
        }
        const b = { messages: msgs, stream: true, stream_options: { include_usage: true },
                    enable_thinking: !!settings.thinking };
        if (modelId) b.model = modelId;
        const num = (v) => (v === '' || v == null || isNaN(+v) ? null : +v);
        if (num(settings.temperature) != null) b.temperature = num(settings.temperature);
        if (num(settings.top_p) != null) b.top_p = num(settings.top_p);
        if (num(settings.max_tokens) != null) b.max_tokens = Math.round(num(settings.max_tokens));
        if (num(settings.seed) != null) b.seed = Math.round(num(settings.seed));
        return b;
    }

    async function stream(conv) {
        const msg = { role: 'assistant', content: '', reasoning: '', stats: null };
        conv.messages.push(msg);
        conv.updated = Date.now();
        const controller = new AbortController();
        busy = { controller, conv, msg, el: null };
        setBusy(true);
        persist();
        renderList();
        renderMessages();
        busy.el = $('messages').lastElementChild;
        hideBanner();

        const t0 = performance.now();
        let tFirst = null, usage = null, finish = null, pending = 0;
        let deltas = 0; // text events: about one per token (the count when no usage came)
        const schedule = () => {
            if (!pending) pending = requestAnimationFrame(() => { pending = 0; refreshStreaming(); });
        };
        try {
            const r = await fetch('v1/chat/completions', {
                method: 'POST',
                headers: Object.assign({ 'Content-Type': 'application/json' }, authHeaders()),
                body: JSON.stringify(requestBody(conv)),
                signal: controller.signal,
            });
            if (!r.ok) {
                let text = r.status + ' ' + r.statusText;
                try {
                    const j = await r.json();
                    if (j.error && j.error.message) text = j.error.message;
                } catch (e) { /* not JSON */ }
                if (r.status === 401) {
                    text = 'The server wants an API key: enter it under Settings (' + text + ')';
                    openPanel('settings');
                    $('set-apikey').focus();
                }
                throw new Error(text);
            }
            const reader = r.body.getReader();
            const dec = new TextDecoder();
            let buf = '';
            for (;;) {
                const { value, done } = await reader.read();
                if (done) break;
                buf += dec.decode(value, { stream: true });
                let nl;
                while ((nl = buf.indexOf('\n')) >= 0) {
                    const line = buf.slice(0, nl).replace(/\r$/, '');
                    buf = buf.slice(nl + 1);
                    if (!line.startsWith('data:')) continue; // blank, ': keep-alive', event:
                    const data = line.slice(5).trim();
                    if (data === '[DONE]') continue;
                    let ev;
                    try {
                        ev = JSON.parse(data);
                    } catch (e) {
                        continue;
                    }
                    if (ev.error) throw new Error(ev.error.message || 'the server reported an error');
                    if (ev.usage) usage = ev.usage;
                    const ch = ev.choices && ev.choices[0];
                    if (!ch) continue;
                    const d = ch.delta || {};
                    if (d.reasoning_content) msg.reasoning += d.reasoning_content;
                    if (d.content) msg.content += d.content;
                    if (d.content || d.reasoning_content) {
                        deltas++;
                        if (tFirst == null) tFirst = performance.now();
                    }
                    if (ch.finish_reason) finish = ch.finish_reason;
                    schedule();
                }
            }
        } catch (e) {
            if (e.name === 'AbortError') finish = 'stopped';
            else msg.error = e.message || String(e);
        }
        const tEnd = performance.now();
        const gen = usage ? usage.completion_tokens : deltas || null;
        // decode rate: the tokens after the first over the time since it
        // came (not measured when they all came in one read)
        const span = tFirst != null ? (tEnd - tFirst) / 1000 : 0;
        msg.stats = {
            completion_tokens: gen,
            estimated: !usage,
            prompt_tokens: usage ? usage.prompt_tokens : null,
            cached_tokens: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null,
            ttft_s: tFirst != null ? (tFirst - t0) / 1000 : null,
            tps: gen > 1 && span >= 0.001 ? (gen - 1) / span : null,
            total_s: (tEnd - t0) / 1000,
            finish,
        };
        if (pending) cancelAnimationFrame(pending);
        busy = null;
        conv.updated = Date.now();
        persist();
        setBusy(false);
        renderList();
        if (conv.id === currentId) renderMessages();
        $('input').focus();
    }

    function stopAnswer() {
        if (busy) busy.controller.abort();
    }

    function setBusy(on) {
        $('send').hidden = on;
        $('stop').hidden = !on;
        document.body.classList.toggle('busy', on);
    }

    // ---- composer ------------------------------------------------------------
    function autosize() {
        const t = $('input');
        t.style.height = 'auto';
        t.style.height = Math.min(t.scrollHeight, 240) + 'px';
    }

    function submit() {
        const t = $('input');
        const text = t.value.trim();
        if (!text || busy) return;
        t.value = '';
        autosize();
        send(text, current());
    }

    // ---- settings ------------------------------------------------------------
    const FIELDS = ['system', 'temperature', 'top_p', 'max_tokens', 'seed'];
    function fillSettings() {
        for (const f of FIELDS) $('set-' + f).value = settings[f];
        $('set-thinking').checked = !!settings.thinking;
        $('set-apikey').value = apiKey;
    }
    function readSettings() {
        for (const f of FIELDS) settings[f] = $('set-' + f).value;
        settings.thinking = $('set-thinking').checked;
        save(LS.settings, settings);
        apiKey = $('set-apikey').value.trim();
        if (apiKey) localStorage.setItem(LS.key, apiKey);
        else localStorage.removeItem(LS.key);
    }

    // ---- side panel ------------------------------------------------------------
    let panelTab = null;
    function openPanel(tab) {
        panelTab = tab;
        $('panel').hidden = false;
        $('settings').hidden = tab !== 'settings';
        $('cluster').hidden = tab !== 'cluster';
        $('panel-title').textContent = tab === 'settings' ? 'Settings' : 'Cluster';
        $('toggle-settings').setAttribute('aria-expanded', String(tab === 'settings'));
        $('toggle-cluster').setAttribute('aria-expanded', String(tab === 'cluster'));
        if (tab === 'cluster') refreshCluster();
    }
    function closePanel() {
        panelTab = null;
        $('panel').hidden = true;
        $('toggle-settings').setAttribute('aria-expanded', 'false');
        $('toggle-cluster').setAttribute('aria-expanded', 'false');
    }
    const togglePanel = (tab) => (panelTab === tab ? closePanel() : openPanel(tab));

    // ---- cluster ---------------------------------------------------------------
    const el = (tag, cls, text) => {
        const e = document.createElement(tag);
        if (cls) e.className = cls;
        if (text != null) e.textContent = text;
        return e;
    };
    const num = (v, d) => (typeof v === 'number' && isFinite(v) ? v : d);
    const pct = (v) => (typeof v === 'number' && isFinite(v) ? (100 * v).toFixed(1) + '%' : '—');
    const bytes = (b) => (b >= 1e9 ? (b / 1e9).toFixed(2) + ' GB' : b >= 1e6 ? (b / 1e6).toFixed(1) + ' MB'
                          : b >= 1e3 ? (b / 1e3).toFixed(1) + ' kB' : Math.round(b) + ' B');
    let noMetrics = false;
    let prevBusy = null; // {t, busy:[...]} for the live busy share

    function renderHealth(h) {
        modelId = h.model || modelId;
        $('model-name').textContent = modelId || 'k3shard';
        $('empty-model').textContent = modelId || 'the model';
        const ok = h.status === 'ok';
        $('health-dot').className = 'dot ' + (ok ? 'ok' : 'warn');
        $('health-dot').title = 'server: ' + (h.status || 'unknown');
        const workers = Array.isArray(h.workers) ? h.workers : [];
        // generations running and their limit: {"running","parallel"}, and
        // those waiting for a slot: "queue" (an older server: "max_queue" was
        // the running limit, or "queue":{"running","max"})
        const q = h.queue && typeof h.queue === 'object' ? h.queue : {};
        const running = num(h.running, num(q.running, null));
        const maxRun = num(h.parallel, num(h.max_queue, num(q.max, null)));
        const waiting = typeof h.queue === 'number' && h.parallel != null ? h.queue : null;
        $('cluster-summary').textContent =
            (workers.length ? workers.length + (workers.length === 1 ? ' worker' : ' workers') + ' · ' : '') +
            (h.layers ? h.layers + ' layers · ' : '') + (running != null ? running + ' running' : '');

        const ov = $('cluster-overview');
        ov.textContent = '';
        const stat = (label, value) => {
            const d = el('div', 'ov');
            d.append(el('span', 'ov-v', String(value)), el('span', 'ov-l', label));
            ov.appendChild(d);
        };
        stat('status', h.status || '?');
        stat('workers', workers.length);
        if (h.layers != null) stat('layers', h.layers);
        if (h.context != null) stat('context', h.context);
        if (running != null) stat('generating', running + ' / ' + num(maxRun, '?'));
        if (waiting) stat('waiting', waiting);
        if (typeof h.sessions === 'number')
            stat('sessions', h.sessions + (h.max_sessions != null ? ' / ' + h.max_sessions : ''));
        if (typeof h.hit_rate === 'number') stat('expert cache hits', pct(h.hit_rate));
        if (typeof h.gb_read === 'number') stat('read from drives', bytes(h.gb_read * 1e9));

        const now = performance.now();
        const busyS = workers.map((w) => num(w.busy_s, 0));
        const total = busyS.reduce((a, b) => a + b, 0);
        let live = null;
        if (prevBusy && prevBusy.busy.length === busyS.length && now > prevBusy.t)
            live = busyS.map((b, i) => Math.max(0, b - prevBusy.busy[i]) / ((now - prevBusy.t) / 1000));
        prevBusy = { t: now, busy: busyS };

        const box = $('workers');
        box.textContent = '';
        if (!workers.length) box.appendChild(el('p', 'hint', 'This server reports no workers in /health.'));
        workers.forEach((w, i) => {
            const card = el('div', 'worker' + (w.alive === false ? ' down' : ''));
            card.dataset.worker = num(w.index, i);
            const top = el('div', 'w-top');
            top.append(el('span', 'dot ' + (w.alive === false ? 'bad' : 'ok')),
                       el('b', null, 'Worker ' + num(w.index, i)),
                       el('span', 'w-ep', w.endpoint || ''));
            top.title = (w.name ? w.name + ' · ' : '') + (w.alive === false ? 'not connected' : 'connected');
            card.appendChild(top);
            const l = Array.isArray(w.layers) ? w.layers : null;
            const grid = el('dl', 'w-grid');
            const row = (k, v) => grid.append(el('dt', null, k), el('dd', null, v));
            row('layers', l ? l[0] + '–' + l[1] + ' (' + (l[1] - l[0] + 1) + ')' : '—');
            row('drive', Array.isArray(w.dirs) && w.dirs.length ? w.dirs.join(', ') : '—');
            row('NUMA node', w.numa != null && w.numa >= 0 ? String(w.numa) : '—');
            row('expert cache hits', pct(w.hit_rate));
            row('read from drive', w.gb_read != null ? bytes(num(w.gb_read, 0) * 1e9) : '—');
            row('busy', num(w.busy_s, 0).toFixed(1) + ' s' + (live ? ' · now ' + pct(Math.min(1, live[i])) : ''));
            if (typeof w.sessions === 'number') row('sessions held', String(w.sessions));
            if (w.failures) row('connection losses', String(w.failures));
            card.appendChild(grid);
            const share = total > 0 ? busyS[i] / total : 0;
            const bar = el('div', 'bar');
            bar.title = 'share of the cluster\'s busy time: ' + pct(share);
            const fill = el('div', 'bar-fill');
            fill.style.width = (100 * share).toFixed(1) + '%';
            bar.appendChild(fill);
            card.append(el('div', 'bar-label', 'busy share ' + pct(total > 0 ? share : NaN)), bar);
            box.appendChild(card);
        });
        $('cluster-updated').textContent = 'updated ' + new Date().toLocaleTimeString();
    }

    // A few server totals from the Prometheus text (docs/SERVING.md 2).
    function renderTotals(lines) {
        const m = {};
        for (const l of lines) {
            const x = /^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(l);
            if (x && !x[2]) m[x[1]] = parseFloat(x[3]);
        }
        const box = $('cluster-totals');
        box.textContent = '';
        const stat = (label, v) => {
            if (v == null || /NaN|Infinity/.test(v)) return;
            const d = el('div', 'ov');
            d.append(el('span', 'ov-v', v), el('span', 'ov-l', label));
            box.appendChild(d);
        };
        const f = (k, d) => (k in m ? m[k].toFixed(d) : null);
        stat('decode tok/s', f('k3_decode_tokens_per_second', 1));
        stat('prefill tok/s', f('k3_prefill_tokens_per_second', 1));
        const n = m.k3_time_to_first_token_seconds_count;
        stat('mean first token', n ? (m.k3_time_to_first_token_seconds_sum / n).toFixed(2) + ' s' : null);
        stat('requests', f('k3_requests_total', 0));
        stat('cancelled', f('k3_requests_cancelled_total', 0));
        stat('tokens out', f('k3_completion_tokens_total', 0));
        stat('prompt tokens', f('k3_prompt_tokens_total', 0));
        stat('reused', f('k3_prompt_tokens_cached_total', 0));
        $('totals-box').hidden = !box.childElementCount;
    }

    async function refreshCluster() {
        try {
            const r = await fetch('health', { headers: authHeaders(), cache: 'no-store' });
            const h = await r.json();
            renderHealth(h);
        } catch (e) {
            $('health-dot').className = 'dot bad';
            $('health-dot').title = 'server unreachable';
            $('cluster-summary').textContent = 'server unreachable';
        }
        if (panelTab !== 'cluster' || noMetrics) return;
        try {
            const r = await fetch('metrics', { headers: authHeaders(), cache: 'no-store' });
            if (r.status === 404) noMetrics = true; // an older server: ask no more
            const t = r.ok ? await r.text() : '';
            const lines = t.split('\n').filter((x) => x && !x.startsWith('#'));
            $('metrics').textContent = lines.length ? lines.join('\n') : 'no /metrics on this server';
            renderTotals(lines);
        } catch (e) {
            $('metrics').textContent = 'no /metrics on this server';
        }
    }

    // ---- start -----------------------------------------------------------------
    function start() {
        if (currentId && !current()) currentId = null;
        fillSettings();
        renderList();
        renderMessages();
        const input = $('input');
        input.addEventListener('keydown', (e) => {
            if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
                e.preventDefault();
                submit();
            }
        });
        input.addEventListener('input', autosize);
        $('composer').addEventListener('submit', (e) => {
            e.preventDefault();
            submit();
        });
        $('stop').onclick = stopAnswer;
        $('new-chat').onclick = () => {
            if (busy) stopAnswer();
            currentId = null;
            persist();
            renderList();
            renderMessages();
            input.focus();
        };
        $('toggle-sidebar').onclick = () => document.body.classList.toggle('side-open');
        $('main').addEventListener('click', (e) => {
            if (!e.target.closest('#toggle-sidebar')) document.body.classList.remove('side-open');
        });
        $('sidebar').addEventListener('click', (e) => {
            if (e.target.closest('.conv-title, #new-chat')) document.body.classList.remove('side-open');
        });
        $('toggle-settings').onclick = () => togglePanel('settings');
        $('toggle-cluster').onclick = () => togglePanel('cluster');
        $('panel-close').onclick = closePanel;
        $('settings').addEventListener('input', readSettings);
        $('settings').addEventListener('change', readSettings);
        $('set-reset').onclick = () => {
            settings = Object.assign({}, DEFAULTS);
            fillSettings();
            readSettings();
        };
        $('messages').addEventListener('click', (e) => {
            const b = e.target.closest('[data-copy]');
            if (!b) return;
            copyText(b.closest('.code').querySelector('code').textContent);
            b.textContent = 'Copied';
            setTimeout(() => (b.textContent = 'Copy'), 1200);
        });
        document.addEventListener('keydown', (e) => {
            if (e.key === 'Escape' && busy) stopAnswer();
        });
        window.addEventListener('storage', (e) => {
            if (e.key === LS.convs && !busy) {
                convs = load(LS.convs, []);
                renderList();
                renderMessages();
            }
        });
        refreshCluster();
        setInterval(() => {
            if (!document.hidden) refreshCluster();
        }, REFRESH_MS);
        input.focus();
    }

    if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
    else start();
})();
