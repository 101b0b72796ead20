// coordinator/web/md.js: Markdown to HTML for model output and user text
// (docs/WEB.md). Safety rule: every character of the input is HTML-escaped
// first; formatting then only adds our own fixed tags around escaped text,
// so `<script>` or `<img onerror=...>` in a model's answer shows as text.
// Links keep only http(s) and mailto targets. Handles an unfinished answer
// (an open ``` fence while streaming renders as a code block so far).
// Exposes window.K3md.render(text) -> HTML string.
'use strict';
(function () {
    const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
    const escape = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

    // Inline formatting of one already-escaped line. Code spans are cut out
    // first so their content is never formatted further.
    function inline(esc) {
        const spans = [];
        esc = esc.replace(/`([^`]+)`/g, (m, code) => {
            spans.push('<code>' + code + '</code>');
            return '\u0000' + (spans.length - 1) + '\u0000';
        });
        esc = esc.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (m, label, url) => {
            // url is escaped text: &amp; stands for &, quotes cannot occur raw
            if (!/^(https?:\/\/|mailto:)/i.test(url)) return m;
            return '<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + '</a>';
        });
        esc = esc.replace(/\*\*([^*]+)\*\*/g, '<strong>$1</strong>');
        esc = esc.replace(/__([^_]+)__/g, '<strong>$1</strong>');
        esc = esc.replace(/(^|[^*\w])\*([^*\s][^*]*?)\*(?!\w)/g, '$1<em>$2</em>');
        esc = esc.replace(/~~([^~]+)~~/g, '<del>$1</del>');
        return esc.replace(/\u0000(\d+)\u0000/g, (m, i) => spans[+i]);
    }

    // Block structure of a text without fences: headings, lists, quotes,
    // rules, paragraphs (single newlines kept as <br>).
    function blocks(text) {
        const lines = text.split('\n');
        let out = '';
        let para = [];
        let list = null; // {tag, items}
        const flushPara = () => {
            if (para.length) out += '<p>' + para.map(inline).join('<br>') + '</p>';
            para = [];
        };
        const flushList = () => {
            if (list) {
                out += '<' + list.tag + '>' + list.items.map((i) => '<li>' + inline(i) + '</li>').join('') +
                       '</' + list.tag + '>';
            }
            list = null;
        };
        for (const raw of lines) {
            const line = escape(raw);
            let m;
            if (!raw.trim()) {
                flushPara();
                flushList();
            } else if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
                flushPara();
                flushList();
                const n = Math.min(m[1].length + 2, 6); // h3..h6 inside a message
                out += '<h' + n + '>' + inline(m[2]) + '</h' + n + '>';
            } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(raw)) {
                flushPara();
                flushList();
                out += '<hr>';
            } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line)) || (m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
                flushPara();
                const tag = /^\s*\d/.test(raw) ? 'ol' : 'ul';
                if (list && list.tag !== tag) flushList();
                if (!list) list = { tag, items: [] };
                list.items.push(m[1]);
            } else if ((m = /^&gt;\s?(.*)$/.exec(line))) {
                flushPara();
                flushList();
                out += '<blockquote>' + inline(m[1]) + '</blockquote>';
            } else if (list && /^\s+/.test(raw)) {
                list.items[list.items.length - 1] += ' ' + line.trim();
            } else {
                flushList();
                para.push(line);
            }
        }
        flushPara();
        flushList();
        return out;
    }

    function render(text) {
        // NUL is the placeholder mark of inline(): never taken from the input
        text = String(text || '').replace(/\r\n?/g, '\n').replace(/\u0000/g, '\uFFFD');
        let out = '';
        // an opening fence at a line start; its block ends at a line that
        // is only ``` or, while the answer is still streaming, at the end
        const open = /(^|\n)```([^\n`]*)(\n|$)/;
        for (;;) {
            const m = open.exec(text);
            if (!m) break;
            const start = m.index + m[1].length;
            const body = m.index + m[0].length;
            const close = /\n```[ \t]*(\n|$)/g;
            close.lastIndex = body - 1; // the body may be empty: its \n is the opener's
            const c = close.exec(text);
            const end = c ? c.index : text.length;
            out += blocks(text.slice(0, start));
            const lang = m[2].trim().replace(/[^\w+#.-]/g, '').slice(0, 20);
            out += '<div class="code"><div class="code-head"><span>' + escape(lang || 'text') +
                   '</span><button type="button" class="copy" data-copy>Copy</button></div>' +
                   '<pre><code>' + escape(text.slice(body, Math.max(body, end))) + '</code></pre></div>';
            text = c ? text.slice(c.index + c[0].length) : '';
        }
        return out + blocks(text);
    }

    window.K3md = { render, escape };
})();
