//! The durable log: an append-only file of checksummed records, the one on-disk record format
//! under the provision journal ([`crate::provision::journal`]) and the hub's outbox and inbox
//! ([`crate::hub::store`]). It knows nothing about what a record means: a record is one line of
//! payload text (JSON by convention) that its owner encodes and decodes.
//!
//! One record per line:
//!
//! ```text
//! {"v":1,"sum":"<64 hex>","rec":<payload>}
//! ```
//!
//! `v` is [`FORMAT_VERSION`]; `sum` is the SHA-256 of the payload bytes exactly as written.
//! Records are size-capped ([`Limits::max_record_bytes`], the line with its newline) and so is
//! the file ([`Limits::max_file_bytes`]): an append over a cap is refused and writes nothing, a
//! file over its cap on disk is not read.
//!
//! Reading ([`LogFile::read`]) checks every line: a torn last line (a write cut short by a
//! crash: no newline, a checksum that does not match, a payload its owner cannot decode) is
//! reported and left out; anything wrong before the last line is corruption, named by file and
//! line. The torn tail is cut off by [`LogFile::cut_tail`] or by the next append. An append
//! ([`LogFile::append`]) writes a whole batch of lines in one `write` and makes it durable with
//! one `fdatasync` (a group commit); a failed write is cut back off. [`LogFile::rewrite`] keeps
//! only some records (write a new file, fsync, rename over, fsync the folder), so a crash
//! leaves either the old or the new file.
//!
//! It may use only std, `crate::error` and small crates (sha2, hex, thiserror), never `hub` or
//! `provision` (they use it). It takes no lock: its owner says who may write a file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The record format version this agent writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Hex digits of a record's checksum.
pub const SUM_HEX_LEN: usize = 64;

const PREFIX: &str = "{\"v\":";
const SUM_KEY: &str = "\"sum\":\"";
const REC_KEY: &str = "\",\"rec\":";

/// Caps on one log file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Cap on one record line (with its newline), in bytes.
    pub max_record_bytes: usize,
    /// Cap on the file, in bytes.
    pub max_file_bytes: u64,
}

/// Why a payload cannot become a record. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The payload is empty or spans lines.
    #[error("the record is not one line of text")]
    NotOneLine,
    /// The encoded line is over the per-record cap.
    #[error("it is {size} bytes, over the cap of {max}")]
    TooLarge {
        /// The encoded line's size (with its newline).
        size: usize,
        /// The cap.
        max: usize,
    },
}

/// Errors of a log file. The owner maps them to its own errors, which say what to do.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The file (or its folder) could not be read, written or synced.
    #[error("cannot read or write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A record before the last line is damaged (or its owner refused it).
    #[error("{path} is corrupt at line {line}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 when read back by position).
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A record was written in a newer format.
    #[error("{path} line {line} has format version {version}, newer than {FORMAT_VERSION}")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0 when read back by position).
        line: usize,
        /// The version found.
        version: u32,
    },
    /// The append would grow the file past its cap; nothing was written.
    #[error("{path} would grow past its cap of {max} bytes")]
    Full {
        /// The file.
        path: PathBuf,
        /// The cap.
        max: u64,
    },
    /// The file on disk is over its cap; it was not read.
    #[error("{path} is {size} bytes, over the cap of {max}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The cap.
        max: u64,
    },
}

/// An owner's error from a [`LogError`]: `Io`, `Corrupt` and `UnsupportedVersion` become the
/// owner's variants of the same names and fields; `Full` and `TooLarge` become what the owner
/// says (its wording names its own caps). For example:
/// `owner_error!(MyError, e, Full { path, max } => …, TooLarge { path, size, max } => …)`.
macro_rules! owner_error {
    ($owner:ident, $e:expr, Full { $($full:tt)* } => $f:expr,
     TooLarge { $($big:tt)* } => $t:expr $(,)?) => {
        match $e {
            $crate::durable_log::LogError::Io { path, source } => $owner::Io { path, source },
            $crate::durable_log::LogError::Corrupt { path, line, reason } => {
                $owner::Corrupt { path, line, reason }
            }
            $crate::durable_log::LogError::UnsupportedVersion { path, line, version } => {
                $owner::UnsupportedVersion { path, line, version }
            }
            $crate::durable_log::LogError::Full { $($full)* } => $f,
            $crate::durable_log::LogError::TooLarge { $($big)* } => $t,
        }
    };
}
pub(crate) use owner_error;

/// What is wrong with one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineError {
    /// A format version this agent does not know.
    Version(u32),
    /// Not a record, or its checksum does not match.
    Damaged(String),
}

/// What a payload decoder says about a record whose checksum matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// The payload does not decode: like a damaged line (a torn tail when it is the last).
    Damaged(String),
    /// The payload decodes but does not belong here: corruption wherever it is.
    Corrupt(String),
}

/// One record read from the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<T> {
    /// 1-based line number.
    pub line: usize,
    /// Byte offset of the line.
    pub offset: u64,
    /// Length of the line with its newline.
    pub len: u32,
    /// The record's checksum (hex).
    pub sum: String,
    /// What the owner decoded from the payload.
    pub value: T,
}

/// A torn last line that was left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Torn {
    /// 1-based line number.
    pub line: usize,
    /// Why it is torn.
    pub reason: String,
}

/// Everything [`LogFile::read`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents<T> {
    /// The valid records, in order.
    pub entries: Vec<Entry<T>>,
    /// The torn last line, if there was one.
    pub torn: Option<Torn>,
}

/// How [`LogFile::open`] opens a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// An existing file, to read only (none if it does not exist).
    Read,
    /// An existing file, to read and append (none if it does not exist).
    Write,
    /// A new file, mode 0600 (none if it already exists).
    CreateNew,
    /// An existing file or a new one, mode 0600.
    Create,
}

/// The SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// fsync a folder, so a file created or renamed in it survives a crash.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Limits {
    /// Encode `payload` as one record line (with its newline), within the per-record cap.
    pub fn encode(&self, payload: &str) -> Result<String, EncodeError> {
        if payload.is_empty() || payload.contains('\n') {
            return Err(EncodeError::NotOneLine);
        }
        let line = format!(
            "{PREFIX}{FORMAT_VERSION},{SUM_KEY}{}{REC_KEY}{payload}}}\n",
            sha256_hex(payload.as_bytes())
        );
        if line.len() > self.max_record_bytes {
            return Err(EncodeError::TooLarge {
                size: line.len(),
                max: self.max_record_bytes,
            });
        }
        Ok(line)
    }
}

/// The checksum of a line made by [`Limits::encode`] (empty for any other text).
pub fn line_sum(line: &str) -> &str {
    line.strip_prefix(PREFIX)
        .and_then(|rest| rest.split_once(SUM_KEY))
        .and_then(|(_, rest)| rest.get(..SUM_HEX_LEN))
        .unwrap_or("")
}

/// Decode one record line (its newline may be left on): the payload and its checksum, once
/// the version is known and the checksum matches.
pub fn decode_line(line: &[u8]) -> Result<(&str, &str), LineError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let text =
        std::str::from_utf8(line).map_err(|_| LineError::Damaged("not UTF-8 text".to_string()))?;
    let damaged = |what: &str| LineError::Damaged(format!("not a record ({what})"));
    let rest = text
        .strip_prefix(PREFIX)
        .ok_or_else(|| damaged("no version"))?;
    let (version, rest) = rest.split_once(',').ok_or_else(|| damaged("no version"))?;
    let version: u32 = version.parse().map_err(|_| damaged("bad version"))?;
    if version != FORMAT_VERSION {
        return Err(LineError::Version(version));
    }
    let rest = rest
        .strip_prefix(SUM_KEY)
        .ok_or_else(|| damaged("no checksum"))?;
    if rest.len() < SUM_HEX_LEN || !rest.is_char_boundary(SUM_HEX_LEN) {
        return Err(damaged("short checksum"));
    }
    let (sum, rest) = rest.split_at(SUM_HEX_LEN);
    let payload = rest
        .strip_prefix(REC_KEY)
        .and_then(|r| r.strip_suffix('}'))
        .ok_or_else(|| damaged("no record"))?;
    if sha256_hex(payload.as_bytes()) != sum {
        return Err(LineError::Damaged(
            "the checksum does not match the record".to_string(),
        ));
    }
    Ok((payload, sum))
}

/// One open log file. See the module docs.
#[derive(Debug)]
pub struct LogFile {
    path: PathBuf,
    file: File,
    limits: Limits,
    /// Where the valid records end (the next append goes here).
    len: u64,
    /// Whether bytes after `len` may be on disk (a torn tail not cut off yet).
    tail: bool,
}

impl LogFile {
    /// Open `path` as `mode` says. `None`: it does not exist ([`OpenMode::Read`],
    /// [`OpenMode::Write`]) or already does ([`OpenMode::CreateNew`]). Until it is
    /// [`LogFile::read`], appends go after whatever the file holds.
    pub fn open(path: &Path, limits: Limits, mode: OpenMode) -> Result<Option<Self>, LogError> {
        let mut options = OpenOptions::new();
        options.read(true);
        match mode {
            OpenMode::Read => {}
            OpenMode::Write => {
                options.write(true);
            }
            OpenMode::CreateNew => {
                options.write(true).create_new(true).mode(0o600);
            }
            OpenMode::Create => {
                options.write(true).create(true).truncate(false).mode(0o600);
            }
        }
        let file = match options.open(path) {
            Ok(file) => file,
            Err(e)
                if (e.kind() == io::ErrorKind::NotFound && mode != OpenMode::Create)
                    || (e.kind() == io::ErrorKind::AlreadyExists
                        && mode == OpenMode::CreateNew) =>
            {
                return Ok(None)
            }
            Err(source) => {
                return Err(LogError::Io {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let len = file
            .metadata()
            .map_err(|source| LogError::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        Ok(Some(LogFile {
            path: path.to_path_buf(),
            file,
            limits,
            len,
            tail: false,
        }))
    }

    /// A file already opened by the caller (for reading only: the caller chose how to open
    /// it, e.g. without following links), known as `path` in messages.
    pub fn from_opened(path: &Path, file: File, limits: Limits) -> Result<Self, LogError> {
        let len = file
            .metadata()
            .map_err(|source| LogError::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        Ok(LogFile {
            path: path.to_path_buf(),
            file,
            limits,
            len,
            tail: false,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the valid records end, in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file holds no valid record.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `bytes` more fit under the file cap.
    pub fn fits(&self, bytes: u64) -> bool {
        self.len + bytes <= self.limits.max_file_bytes
    }

    fn io_err(&self) -> impl Fn(io::Error) -> LogError + '_ {
        move |source| LogError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Read every record, checking each line and handing each payload to `decode`. Writes
    /// nothing: a torn last line is reported in [`Contents::torn`] and left on disk.
    pub fn read<T>(
        &mut self,
        mut decode: impl FnMut(&str) -> Result<T, Reject>,
    ) -> Result<Contents<T>, LogError> {
        let size = self.file.metadata().map_err(self.io_err())?.len();
        if size > self.limits.max_file_bytes {
            return Err(LogError::TooLarge {
                path: self.path.clone(),
                size,
                max: self.limits.max_file_bytes,
            });
        }
        let mut bytes = vec![0u8; usize::try_from(size).unwrap_or(0)];
        self.file
            .read_exact_at(&mut bytes, 0)
            .map_err(self.io_err())?;
        let mut contents = Contents {
            entries: Vec::new(),
            torn: None,
        };
        let mut offset = 0usize;
        let mut line_no = 0usize;
        while offset < bytes.len() {
            line_no += 1;
            let rest = &bytes[offset..];
            let Some(end) = rest.iter().position(|b| *b == b'\n') else {
                contents.torn = Some(Torn {
                    line: line_no,
                    reason: "no newline: a write cut short by a crash".to_string(),
                });
                break;
            };
            let next = offset + end + 1;
            let is_last = next >= bytes.len();
            let corrupt = |reason: String| LogError::Corrupt {
                path: self.path.clone(),
                line: line_no,
                reason,
            };
            let damaged = match decode_line(&rest[..end]) {
                Ok((payload, sum)) => match decode(payload) {
                    Ok(value) => {
                        contents.entries.push(Entry {
                            line: line_no,
                            offset: offset as u64,
                            len: u32::try_from(end + 1).unwrap_or(u32::MAX),
                            sum: sum.to_string(),
                            value,
                        });
                        offset = next;
                        continue;
                    }
                    Err(Reject::Corrupt(reason)) => return Err(corrupt(reason)),
                    Err(Reject::Damaged(reason)) => reason,
                },
                Err(LineError::Version(version)) => {
                    return Err(LogError::UnsupportedVersion {
                        path: self.path.clone(),
                        line: line_no,
                        version,
                    })
                }
                Err(LineError::Damaged(reason)) => reason,
            };
            if !is_last {
                return Err(corrupt(damaged));
            }
            contents.torn = Some(Torn {
                line: line_no,
                reason: damaged,
            });
            break;
        }
        self.len = offset as u64;
        self.tail = offset < bytes.len();
        Ok(contents)
    }

    /// Cut a torn tail off the file (synced). Returns whether there was one.
    pub fn cut_tail(&mut self) -> Result<bool, LogError> {
        let size = self.file.metadata().map_err(self.io_err())?.len();
        self.tail = false;
        if size == self.len {
            return Ok(false);
        }
        self.file
            .set_len(self.len)
            .and_then(|()| self.file.sync_data())
            .map_err(self.io_err())?;
        Ok(true)
    }

    /// Append whole record lines (from [`Limits::encode`]) after the valid records, in one
    /// `write` and one `fdatasync`; a torn tail is cut off first. Returns the offset of the
    /// first. Either every line is stored or the file is left as it was.
    pub fn append(&mut self, lines: &[u8]) -> Result<u64, LogError> {
        let add = lines.len() as u64;
        if !self.fits(add) {
            return Err(LogError::Full {
                path: self.path.clone(),
                max: self.limits.max_file_bytes,
            });
        }
        let start = self.len;
        if self.tail {
            self.file.set_len(start).map_err(self.io_err())?;
            self.tail = false;
        }
        let written = self
            .file
            .write_all_at(lines, start)
            .and_then(|()| self.file.sync_data());
        if let Err(source) = written {
            // Leave the file as it was: a partial batch must not be read as stored.
            let _ = self.file.set_len(start);
            return Err(LogError::Io {
                path: self.path.clone(),
                source,
            });
        }
        self.len = start + add;
        Ok(start)
    }

    /// Read the record line at `offset` (`len` bytes with its newline) back and check it again;
    /// returns its payload.
    pub fn read_at(&self, offset: u64, len: u32) -> Result<String, LogError> {
        let mut buf = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut buf, offset)
            .map_err(self.io_err())?;
        match decode_line(&buf) {
            Ok((payload, _)) => Ok(payload.to_string()),
            Err(LineError::Version(version)) => Err(LogError::UnsupportedVersion {
                path: self.path.clone(),
                line: 0,
                version,
            }),
            Err(LineError::Damaged(reason)) => Err(LogError::Corrupt {
                path: self.path.clone(),
                line: 0,
                reason: format!("the record at byte {offset}: {reason}"),
            }),
        }
    }

    /// Empty the file (synced).
    pub fn truncate(&mut self) -> Result<(), LogError> {
        self.file
            .set_len(0)
            .and_then(|()| self.file.sync_data())
            .map_err(self.io_err())?;
        self.len = 0;
        self.tail = false;
        Ok(())
    }

    /// Keep only the records at `keep` (offset and length, in order): they are written to
    /// `<file>.tmp`, which is synced and renamed over the file, and the folder is synced.
    /// Returns their new offsets.
    pub fn rewrite(&mut self, keep: &[(u64, u32)]) -> Result<Vec<u64>, LogError> {
        let mut tmp_name = self.path.clone().into_os_string();
        tmp_name.push(".tmp");
        let tmp_path = PathBuf::from(tmp_name);
        let tmp_err = |source| LogError::Io {
            path: tmp_path.clone(),
            source,
        };
        let mut tmp = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp_path)
            .map_err(tmp_err)?;
        let mut offsets = Vec::with_capacity(keep.len());
        let mut offset = 0u64;
        let mut buf = Vec::new();
        for &(at, len) in keep {
            let start = buf.len();
            buf.resize(start + len as usize, 0);
            self.file
                .read_exact_at(&mut buf[start..], at)
                .map_err(self.io_err())?;
            offsets.push(offset);
            offset += u64::from(len);
            if buf.len() >= 1024 * 1024 {
                tmp.write_all(&buf).map_err(tmp_err)?;
                buf.clear();
            }
        }
        tmp.write_all(&buf)
            .and_then(|()| tmp.sync_all())
            .map_err(tmp_err)?;
        fs::rename(&tmp_path, &self.path).map_err(self.io_err())?;
        if let Some(dir) = self.path.parent() {
            sync_dir(dir).map_err(|source| LogError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        self.file = tmp;
        self.len = offset;
        self.tail = false;
        Ok(offsets)
    }
}

#[cfg(test)]
mod tests;
