//! PTX tokenizer: identifiers (directives, opcodes with their dotted modifiers, registers, labels), numbers,
//! strings and punctuation, each tagged with its line.
//!
//! Tokens are produced on demand and borrow their text from the source, so lexing needs no memory beyond the
//! parser's small lookahead, whatever the size of the input; the token count is capped by
//! [`crate::Limits::max_tokens`].

use crate::ParseError;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tok<'s> {
    /// Identifier, directive (`.reg`), dotted opcode (`ld.global.f32`), register (`%r1`, `%tid.x`) or label.
    Ident(&'s str),
    Int(u64),
    /// `0fXXXXXXXX`: f32 bits.
    F32(u32),
    /// `0dXXXXXXXXXXXXXXXX` or a decimal float literal: f64 bits.
    F64(u64),
    Str(&'s str),
    Punct(char),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Token<'s> {
    pub tok: Tok<'s>,
    pub line: usize,
}

fn ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn ident_cont(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.' | b':')
}

/// A pull tokenizer over PTX text.
pub struct Lexer<'s> {
    src: &'s str,
    pos: usize,
    line: usize,
    produced: usize,
    max_tokens: usize,
}

impl<'s> Lexer<'s> {
    pub fn new(src: &'s str, max_tokens: usize) -> Lexer<'s> {
        Lexer {
            src,
            pos: 0,
            line: 1,
            produced: 0,
            max_tokens,
        }
    }

    /// The line the lexer has reached (the last line at the end of the input).
    pub fn line(&self) -> usize {
        self.line
    }

    /// The next token, `None` at the end of the input.
    pub fn next_token(&mut self) -> Result<Option<Token<'s>>, ParseError> {
        let src = self.src;
        let b = src.as_bytes();
        let err = |line, expected: &str, found: String| ParseError {
            line,
            expected: expected.into(),
            found,
            limit: None,
        };
        let i = &mut self.pos;
        let line = &mut self.line;
        loop {
            let Some(&c) = b.get(*i) else {
                return Ok(None);
            };
            match c {
                b'\n' => {
                    *line += 1;
                    *i += 1;
                }
                c if c.is_ascii_whitespace() => *i += 1,
                b'/' if b.get(*i + 1) == Some(&b'/') => {
                    while *i < b.len() && b[*i] != b'\n' {
                        *i += 1;
                    }
                }
                b'/' if b.get(*i + 1) == Some(&b'*') => {
                    *i += 2;
                    loop {
                        if *i + 1 >= b.len() {
                            return Err(err(
                                *line,
                                "end of block comment `*/`",
                                "end of input".into(),
                            ));
                        }
                        if b[*i] == b'*' && b[*i + 1] == b'/' {
                            *i += 2;
                            break;
                        }
                        if b[*i] == b'\n' {
                            *line += 1;
                        }
                        *i += 1;
                    }
                }
                _ => break,
            }
        }
        if self.produced >= self.max_tokens {
            return Err(ParseError {
                limit: Some("max_tokens"),
                ..err(
                    *line,
                    &format!("at most {} tokens (Limits::max_tokens)", self.max_tokens),
                    "a longer module".into(),
                )
            });
        }
        self.produced += 1;
        let c = b[*i];
        let tok = match c {
            b'"' => {
                let start = *i + 1;
                *i += 1;
                while *i < b.len() && b[*i] != b'"' {
                    if b[*i] == b'\n' {
                        return Err(err(*line, "closing `\"`", "end of line".into()));
                    }
                    *i += 1;
                }
                // Both ends are ASCII quotes (or the end of the text), so this is a char boundary.
                let s = &src[start..(*i).min(b.len())];
                *i += 1;
                Tok::Str(s)
            }
            c if c.is_ascii_digit() => {
                let start = *i;
                while *i < b.len() && (b[*i].is_ascii_alphanumeric() || b[*i] == b'.') {
                    // exponent sign in decimal floats: 1.5e-3
                    *i += 1;
                    if *i < b.len()
                        && matches!(b[*i], b'+' | b'-')
                        && matches!(b[*i - 1], b'e' | b'E')
                        && !b[start..*i].starts_with(b"0x")
                        && !b[start..*i].starts_with(b"0X")
                        && b[start..*i].contains(&b'.')
                    {
                        *i += 1;
                    }
                }
                let text = &src[start..*i];
                number(text).ok_or_else(|| err(*line, "a number", format!("`{text}`")))?
            }
            c if ident_start(c) => {
                let start = *i;
                *i += 1;
                while *i < b.len() && ident_cont(b[*i]) {
                    // `::` belongs to modifiers such as `.L2::cache_hint`; a single `:` ends a label.
                    if b[*i] == b':' && b.get(*i + 1) != Some(&b':') && b[*i - 1] != b':' {
                        break;
                    }
                    *i += 1;
                }
                Tok::Ident(&src[start..*i])
            }
            b'{' | b'}' | b'[' | b']' | b'(' | b')' | b',' | b';' | b':' | b'+' | b'-' | b'<'
            | b'>' | b'@' | b'!' | b'=' | b'|' | b'*' => {
                *i += 1;
                Tok::Punct(c as char)
            }
            _ => {
                // Report the whole character, not one byte of it.
                let ch = src[*i..].chars().next().unwrap_or('\u{fffd}');
                return Err(err(*line, "a PTX token", format!("character {ch:?}")));
            }
        };
        Ok(Some(Token { tok, line: *line }))
    }
}

/// Tokenizes all of `src` (tests and tools; the parser pulls tokens one at a time).
#[cfg(test)]
pub fn tokenize(src: &str) -> Result<Vec<Token<'_>>, ParseError> {
    let mut lx = Lexer::new(src, usize::MAX);
    let mut out = Vec::new();
    while let Some(t) = lx.next_token()? {
        out.push(t);
    }
    Ok(out)
}

fn number(t: &str) -> Option<Tok<'static>> {
    let t2 = t.strip_suffix('U').unwrap_or(t);
    if let Some(h) = t.strip_prefix("0f").or_else(|| t.strip_prefix("0F"))
        && h.len() == 8
    {
        return u32::from_str_radix(h, 16).ok().map(Tok::F32);
    }
    if let Some(h) = t.strip_prefix("0d").or_else(|| t.strip_prefix("0D"))
        && h.len() == 16
    {
        return u64::from_str_radix(h, 16).ok().map(Tok::F64);
    }
    if let Some(h) = t2.strip_prefix("0x").or_else(|| t2.strip_prefix("0X")) {
        return u64::from_str_radix(h, 16).ok().map(Tok::Int);
    }
    if let Some(h) = t2.strip_prefix("0b").or_else(|| t2.strip_prefix("0B")) {
        return u64::from_str_radix(h, 2).ok().map(Tok::Int);
    }
    if t2.contains('.') || t2.contains('e') || t2.contains('E') {
        return t2.parse::<f64>().ok().map(|f| Tok::F64(f.to_bits()));
    }
    if t2.len() > 1 && t2.starts_with('0') {
        return u64::from_str_radix(&t2[1..], 8).ok().map(Tok::Int);
    }
    t2.parse::<u64>().ok().map(Tok::Int)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_borrow_the_source() {
        let t = tokenize("ld.global.f32 %f1, [%rd1+4]; // c\n/* x\n */ 0f3F800000 \"s\"").unwrap();
        assert_eq!(t[0].tok, Tok::Ident("ld.global.f32"));
        assert_eq!(t[1].tok, Tok::Ident("%f1"));
        assert_eq!(t[5].tok, Tok::Punct('+'));
        assert_eq!(t[6].tok, Tok::Int(4));
        let f = t.iter().find(|t| matches!(t.tok, Tok::F32(_))).unwrap();
        assert_eq!(f.tok, Tok::F32(0x3F80_0000));
        assert_eq!(f.line, 3);
        assert_eq!(t.last().unwrap().tok, Tok::Str("s"));
    }

    #[test]
    fn token_cap_is_an_error() {
        let mut lx = Lexer::new("a b c", 2);
        assert!(lx.next_token().unwrap().is_some());
        assert!(lx.next_token().unwrap().is_some());
        let e = lx.next_token().unwrap_err();
        assert!(e.expected.contains("max_tokens"), "{e}");
        assert_eq!(e.limit, Some("max_tokens"));
        // Trailing whitespace and comments are not tokens.
        let mut lx = Lexer::new("a b  // c\n", 2);
        while lx.next_token().unwrap().is_some() {}
    }

    #[test]
    fn non_ascii_is_reported_whole() {
        let e = tokenize("a é").unwrap_err();
        assert!(e.found.contains('é'), "{e}");
    }
}
