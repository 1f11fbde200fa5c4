//! PTX tokenizer: identifiers (directives, opcodes with their dotted modifiers, registers, labels), numbers,
//! strings and punctuation, each tagged with its line.

use crate::ParseError;

#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    /// Identifier, directive (`.reg`), dotted opcode (`ld.global.f32`), register (`%r1`, `%tid.x`) or label.
    Ident(String),
    Int(u64),
    /// `0fXXXXXXXX`: f32 bits.
    F32(u32),
    /// `0dXXXXXXXXXXXXXXXX` or a decimal float literal: f64 bits.
    F64(u64),
    Str(String),
    Punct(char),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Token {
    pub tok: Tok,
    pub line: usize,
}

fn ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn ident_cont(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.' | b':')
}

pub fn tokenize(src: &str) -> Result<Vec<Token>, ParseError> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let err = |line, expected: &str, found: String| ParseError {
        line,
        expected: expected.into(),
        found,
    };
    while i < b.len() {
        let c = b[i];
        match c {
            b'\n' => {
                line += 1;
                i += 1;
            }
            c if c.is_ascii_whitespace() => i += 1,
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                loop {
                    if i + 1 >= b.len() {
                        return Err(err(
                            line,
                            "end of block comment `*/`",
                            "end of input".into(),
                        ));
                    }
                    if b[i] == b'*' && b[i + 1] == b'/' {
                        i += 2;
                        break;
                    }
                    if b[i] == b'\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\n' {
                        return Err(err(line, "closing `\"`", "end of line".into()));
                    }
                    i += 1;
                }
                let s = String::from_utf8_lossy(&b[start..i.min(b.len())]).into_owned();
                i += 1;
                out.push(Token {
                    tok: Tok::Str(s),
                    line,
                });
            }
            c if c.is_ascii_digit() => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                    // exponent sign in decimal floats: 1.5e-3
                    i += 1;
                    if i < b.len()
                        && matches!(b[i], b'+' | b'-')
                        && matches!(b[i - 1], b'e' | b'E')
                        && !b[start..i].starts_with(b"0x")
                        && !b[start..i].starts_with(b"0X")
                        && b[start..i].contains(&b'.')
                    {
                        i += 1;
                    }
                }
                let text = &src[start..i];
                let tok = number(text).ok_or_else(|| err(line, "a number", format!("`{text}`")))?;
                out.push(Token { tok, line });
            }
            c if ident_start(c) => {
                let start = i;
                i += 1;
                while i < b.len() && ident_cont(b[i]) {
                    // `::` belongs to modifiers such as `.L2::cache_hint`; a single `:` ends a label.
                    if b[i] == b':' && b.get(i + 1) != Some(&b':') && (i == 0 || b[i - 1] != b':') {
                        break;
                    }
                    i += 1;
                }
                out.push(Token {
                    tok: Tok::Ident(src[start..i].to_string()),
                    line,
                });
            }
            b'{' | b'}' | b'[' | b']' | b'(' | b')' | b',' | b';' | b':' | b'+' | b'-' | b'<'
            | b'>' | b'@' | b'!' | b'=' | b'|' | b'*' => {
                out.push(Token {
                    tok: Tok::Punct(c as char),
                    line,
                });
                i += 1;
            }
            _ => {
                return Err(err(
                    line,
                    "a PTX token",
                    format!("character {:?}", c as char),
                ));
            }
        }
    }
    Ok(out)
}

fn number(t: &str) -> Option<Tok> {
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
