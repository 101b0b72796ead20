// tests/tok/oracle.cjs: the tiktoken side of tests/integration/test_tiktoken.sh.
//
// The oracle is the WASM core of the npm package `tiktoken` (pinned in
// package-lock.json): a Tiktoken built from a rank table, no special tokens
// and a split regex. Commands:
//   node oracle.cjs o200k-model OUT          o200k_base ranks as a tiktoken.model
//   node oracle.cjs cases OUT                the test strings (cases.bin format of
//                                            docs/INTERFACES.md 1.7: u32 count, then
//                                            u32 length + bytes per case)
//   node oracle.cjs expect MODEL PAT CASES OUT   one line of ids per case
//   node oracle.cjs compare EXPECTED GOT LABEL CASES   ok / not ok per group
// PAT is "kimi" (docs/INTERFACES.md 1.3, written with its && classes, which the
// Rust regex engine inside tiktoken understands) or "o200k" (the package's own
// o200k_base pat_str).
//
// Invalid UTF-8: tiktoken's JS API takes JS strings only (a lone surrogate
// becomes U+FFFD on the way into WASM) and has no raw-bytes encode, so bytes
// that are not valid UTF-8 cannot reach it. The C tokenizer's contract
// (common/text/tokenizer.h) is that every such byte is a piece of its own, encoded
// as its single-byte token, and that the valid runs around it are split as if
// the byte were the end/start of the text. The expectation here follows that
// contract with tiktoken doing all the real work: each maximal valid run is
// encoded by tiktoken on its own, each invalid byte maps to tiktoken's id for
// that one byte (encode_single_token). Validity is decided by this file's own
// UTF-8 checker (shortest form, no surrogates, <= U+10FFFF), written
// independently of the C one.
"use strict";
const fs = require("fs");
const path = require("path");
const { Tiktoken } = require("tiktoken");

const KIMI_PAT = [
  "[\\p{Han}]+",
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
  "\\p{N}{1,3}",
  " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*",
  "\\s*[\\r\\n]+",
  "\\s+(?!\\S)",
  "\\s+",
].join("|");

function o200k() {
  return require("tiktoken/encoders/o200k_base.json");
}

// The 18 strings of docs/INTERFACES.md 1.7, in order.
const CORPUS = [
  "Hello, world! The quick brown fox jumps over 12345 lazy dogs.",
  "def main():\n    return {'a': 1}\n",
  "Kimi K3 是一个开源模型。它支持中文和English mixed text!",
  "  indented\n\n\nnewlines\t\ttabs   ",
  "I'll say we've DONE it. HTTPResponse XMLHttpRequest",
  "今天天气怎么样？我们去公园散步吧。",
  "日本語のテキストです。カタカナとひらがな、漢字も。",
  "한국어 텍스트도 있습니다.",
  "naïve café résumé ÜBER Straße mañana",
  "don't CAN'T it's I'M we'RE you'll",
  "1 12 123 1234 12345 3.14159 -42",
  "!!! ??? ... --- /// ***bold*** `code`",
  "  a\n\n\nb\t\t  c   \n d  ",
  "🚀 emoji test 🎉 ½ ² € §",
  "iPhone macOS HTTPResponse XMLHttpRequest camelCase snake_case",
  "々 〇 一二三 中中中English中文",
  "\r\nwindows\r\nline\r\nendings\r\n",
  "mixed 中文with no space英文boundaries测试",
];

// mulberry32: a small seeded PRNG so the random cases are the same every run.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Fragment makers. Scripts come from blocks assigned long before Unicode 14
// (the C side's PCRE2 tables) so table versions cannot differ.
function makeFragments(R) {
  const pick = (a) => a[Math.floor(R() * a.length)];
  const int = (lo, hi) => lo + Math.floor(R() * (hi - lo + 1));
  const range = (lo, hi, n) => {
    let s = "";
    for (let i = 0; i < n; i++) s += String.fromCodePoint(int(lo, hi));
    return s;
  };
  const words = ["the", "quick", "brown", "fox", "HTTP", "Response", "camelCase", "snake_case",
    "iPhone", "XMLHttpRequest", "don", "it", "you", "we", "I", "ÜBER", "naïve", "Straße",
    "mañana", "ǅemal", "ǈubljana", "ﬁne", "ſtate", "ΣΊΣΥΦΟΣ", "Москва", "данные", "שלום",
    "مرحبا", "हिन्दी", "ภาษาไทย", "ελληνικά", "Ǆ", "ᾼ", "ʰello", "ªº", "e\u0301", "A\u030A"];
  const contr = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL",
    "'D", "'ſ", "'x", "'"];
  const punct = ["!", "?", "...", "---", "///", "/", "*", "`", "(", ")", "{", "}", "[", "]", "<", ">",
    "<|open|>", "<|sep|>", "[BOS]", "#", "@", "$", "%", "^", "&", "=", "+", "~", "|", "\\", "\"",
    ":", ";", ",", ".", "。", "、", "？", "！", "«", "»", "—", "…", "•", "©", "€", "½", "²", "§"];
  const spaces = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "\t\t  ", "\u00a0",
    "\u3000", "\u2028", "\u0085", "\u2003", "\u180e", "\u200b", "\u000b", "\u000c", " \r\n "];
  const emoji = ["🚀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "😀", "🤖", "✨", "🧪"];
  const invalid = [[0xff], [0xfe], [0xc0], [0xc1, 0xbf], [0x80], [0xbf, 0x80], [0xe4, 0xb8],
    [0xed, 0xa0, 0x80], [0xe0, 0x80, 0x80], [0xf5, 0x80], [0xf0, 0x9f, 0x9a], [0xf4, 0x90, 0x80, 0x80],
    [0xe4], [0xf0]];
  return [
    () => pick(words),
    () => pick(words) + pick(contr),
    () => " " + pick(words),
    () => pick(words).toUpperCase(),
    () => pick(contr),
    () => String(int(0, 10 ** int(1, 9))),
    () => range(0x30, 0x39, int(1, 7)),
    () => range(0x0660, 0x0669, int(1, 4)), // Arabic-Indic digits
    () => range(0xff10, 0xff19, int(1, 3)), // fullwidth digits
    () => pick(punct),
    () => pick(punct) + pick(punct),
    () => pick(spaces),
    () => pick(spaces) + pick(spaces),
    () => pick(emoji),
    () => range(0x4e00, 0x9fa5, int(1, 6)), // CJK unified
    () => range(0x3400, 0x4db5, int(1, 2)), // CJK ext A
    () => range(0x20000, 0x2a6d6, int(1, 2)), // CJK ext B
    () => range(0x2e80, 0x2e99, 1) + range(0x2f00, 0x2fd5, 1), // radicals (So, Han)
    () => pick(["々", "〇", "〡", "〻", "ゝ", "ー", "・"]) + range(0x4e00, 0x4e20, 1),
    () => range(0x3041, 0x3096, int(1, 5)), // hiragana
    () => range(0x30a1, 0x30fa, int(1, 5)), // katakana
    () => range(0xac00, 0xd7a3, int(1, 4)), // hangul
    () => range(0x0410, 0x044f, int(1, 8)), // cyrillic
    () => range(0x0391, 0x03a9, int(1, 3)) + range(0x03b1, 0x03c9, int(1, 5)),
    () => range(0x05d0, 0x05ea, int(1, 5)), // hebrew
    () => range(0x0627, 0x064a, int(1, 5)), // arabic letters
    () => range(0x0905, 0x0939, 1) + range(0x093e, 0x094c, 1) + range(0x0901, 0x0903, 1), // devanagari + marks
    () => range(0x0e01, 0x0e2e, int(1, 4)) + range(0x0e31, 0x0e3a, 1), // thai + marks
    () => range(0x0300, 0x036f, int(1, 2)), // bare combining marks
    () => range(0xff21, 0xff3a, int(1, 3)) + range(0xff41, 0xff5a, int(1, 3)), // fullwidth latin
    () => range(0x00c0, 0x024f, int(1, 5)), // latin extended
    () => range(0x1d400, 0x1d7ff, int(1, 2)), // math alphanumerics (Lu/Ll/Nd)
    () => range(0x2160, 0x2188, 1), // roman numerals (Nl)
    () => range(0x2070, 0x209c, int(1, 2)), // super/subscripts
    () => range(0x2200, 0x22ff, int(1, 3)), // math symbols
    () => range(0x01, 0x1f, 1), // C0 controls
    () => range(0xe000, 0xe0ff, 1), // private use
    () => ({ bytes: pick(invalid) }),
  ];
}

// Returns a Buffer: fragments are strings (UTF-8) or {bytes} (raw).
function randomCase(R, frags, minBytes, maxFrags) {
  const parts = [];
  let n = 0;
  const k = 1 + Math.floor(R() * maxFrags);
  for (let i = 0; i < k || n < minBytes; i++) {
    const f = frags[Math.floor(R() * frags.length)]();
    const b = typeof f === "string" ? Buffer.from(f, "utf8") : Buffer.from(f.bytes);
    parts.push(b);
    n += b.length;
  }
  return Buffer.concat(parts);
}

function buildCases() {
  const cases = CORPUS.map((s) => Buffer.from(s, "utf8"));
  const R = rng(20260603);
  const frags = makeFragments(R);
  for (let i = 0; i < 500; i++) cases.push(randomCase(R, frags, 0, 40));
  // The 1 MB text: corpus strings and random fragments, ~1,000,000 bytes.
  const big = [];
  let n = 0;
  while (n < 1000000) {
    const b = R() < 0.2 ? Buffer.from(CORPUS[Math.floor(R() * CORPUS.length)] + "\n", "utf8")
      : randomCase(R, frags, 0, 30);
    big.push(b);
    n += b.length;
  }
  cases.push(Buffer.concat(big).subarray(0, 1000000));
  return cases;
}

function writeCases(file, cases) {
  const hdr = Buffer.alloc(4);
  hdr.writeUInt32LE(cases.length);
  const parts = [hdr];
  for (const c of cases) {
    const l = Buffer.alloc(4);
    l.writeUInt32LE(c.length);
    parts.push(l, c);
  }
  fs.writeFileSync(file, Buffer.concat(parts));
}

function readCases(file) {
  const b = fs.readFileSync(file);
  const n = b.readUInt32LE(0);
  const out = [];
  let o = 4;
  for (let i = 0; i < n; i++) {
    const l = b.readUInt32LE(o);
    out.push(b.subarray(o + 4, o + 4 + l));
    o += 4 + l;
  }
  return out;
}

// Length of the valid UTF-8 sequence at b[i], or 0.
function seqLen(b, i) {
  const c = b[i];
  if (c < 0x80) return 1;
  let len, lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) len = 2;
  else if (c === 0xe0) { len = 3; lo = 0xa0; }
  else if (c === 0xed) { len = 3; hi = 0x9f; }
  else if (c >= 0xe1 && c <= 0xef) len = 3;
  else if (c === 0xf0) { len = 4; lo = 0x90; }
  else if (c === 0xf4) { len = 4; hi = 0x8f; }
  else if (c >= 0xf1 && c <= 0xf3) len = 4;
  else return 0;
  if (i + len > b.length) return 0;
  if (b[i + 1] < lo || b[i + 1] > hi) return 0;
  for (let k = 2; k < len; k++) if ((b[i + k] & 0xc0) !== 0x80) return 0;
  return len;
}

function expectIds(enc, buf) {
  const ids = [];
  let i = 0;
  while (i < buf.length) {
    let j = i, l;
    while (j < buf.length && (l = seqLen(buf, j)) > 0) j += l;
    if (j > i) for (const id of enc.encode_ordinary(buf.subarray(i, j).toString("utf8"))) ids.push(id);
    if (j < buf.length) {
      ids.push(enc.encode_single_token(Uint8Array.of(buf[j])));
      j++;
    }
    i = j;
  }
  return ids;
}

function main() {
  const [cmd, ...a] = process.argv.slice(2);
  if (cmd === "o200k-model") {
    const o = o200k();
    const enc = new Tiktoken(o.bpe_ranks, {}, o.pat_str);
    const lines = [];
    for (let r = 0; ; r++) {
      let b;
      try { b = enc.decode_single_token_bytes(r); } catch (e) { break; }
      lines.push(Buffer.from(b).toString("base64") + " " + r);
    }
    // No enc.free(): the failed lookup that ends the loop leaves the WASM
    // object borrowed; the process exits right after.
    fs.mkdirSync(path.dirname(a[0]), { recursive: true });
    fs.writeFileSync(a[0], lines.join("\n") + "\n");
    console.log(`# o200k_base: ${lines.length} ranks written to ${a[0]}`);
  } else if (cmd === "cases") {
    const cases = buildCases();
    writeCases(a[0], cases);
    console.log(`# ${cases.length} cases written to ${a[0]}`);
  } else if (cmd === "expect") {
    const [model, pat, casesFile, out] = a;
    const patStr = pat === "kimi" ? KIMI_PAT : o200k().pat_str;
    const enc = new Tiktoken(fs.readFileSync(model, "utf8"), {}, patStr);
    const cases = readCases(casesFile);
    const t0 = Date.now();
    const lines = cases.map((c) => expectIds(enc, c).join(" "));
    enc.free();
    fs.writeFileSync(out, lines.join("\n") + "\n");
    console.log(`# tiktoken (${pat}): ${cases.length} cases in ${Date.now() - t0} ms`);
  } else if (cmd === "compare") {
    // Per group (the 18 corpus strings, the 500 random ones, the 1 MB text):
    // one ok / not ok line, with the first differing case on failure.
    const [expFile, gotFile, label, casesFile] = a;
    const exp = fs.readFileSync(expFile, "utf8").split("\n");
    const got = fs.readFileSync(gotFile, "utf8").split("\n");
    const cases = readCases(casesFile);
    const groups = [["18 corpus strings (docs/INTERFACES.md 1.7)", 0, 18], ["500 random strings", 18, 518],
      ["the 1 MB text", 518, 519]];
    for (const [name, lo, hi] of groups) {
      let bad = 0, first = -1, nIds = 0;
      for (let i = lo; i < hi; i++) {
        nIds += exp[i] ? exp[i].split(" ").length : 0;
        if (exp[i] !== got[i]) { bad++; if (first < 0) first = i; }
      }
      if (bad === 0) {
        console.log(`ok - ${label}: ${name}: all ${nIds} ids identical to tiktoken`);
      } else {
        console.log(`not ok - ${label}: ${name}: ${bad} of ${hi - lo} cases differ`);
        const e = exp[first].split(" "), g = (got[first] || "").split(" ");
        let k = 0;
        while (k < e.length && e[k] === g[k]) k++;
        console.log(`# case ${first} ${JSON.stringify(cases[first].toString("utf8").slice(0, 200))}`);
        console.log(`# first difference at id ${k}: tiktoken ${e.slice(k, k + 8).join(" ")} | C ${g.slice(k, k + 8).join(" ")}`);
      }
    }
  } else {
    console.error("usage: oracle.cjs o200k-model OUT | cases OUT | expect MODEL PAT CASES OUT");
    process.exit(2);
  }
}

main();
