// The log health page: each log's newest checkpoint verified in this browser (verify.js),
// against the key pinned here, and consistent with the last checkpoint this browser saw.
import { checkLog, forget, pin, pins, VerifyError } from "./verify.js";

const body = document.querySelector("#logs tbody");
const template = document.getElementById("row-template");

function rowFor(origin) {
  for (const row of body.querySelectorAll("tr.log")) {
    if (row.dataset.origin === origin) return row;
  }
  const row = template.content.firstElementChild.cloneNode(true);
  row.dataset.origin = origin;
  row.querySelector(".origin").textContent = origin;
  body.appendChild(row);
  return row;
}

function say(row, text, state) {
  const verdict = row.querySelector(".verdict");
  verdict.textContent = text;
  verdict.className = `verdict status-${state}`;
}

async function check(row) {
  const origin = row.dataset.origin;
  const key = pins()[origin];
  if (!key) {
    say(row, "not pinned: pin this log's key below to verify it", "unpinned");
    return;
  }
  say(row, "checking…", "checking");
  try {
    const { checkpoint, previous } = await checkLog(origin, key);
    row.querySelector(".size").textContent = checkpoint.size.toString();
    row.querySelector(".root code").textContent = btoa(String.fromCharCode(...checkpoint.root));
    const witnesses = checkpoint.cosigners.map((name) => `${name} (not verified)`);
    row.querySelector(".signers").textContent = [`${checkpoint.signer} (verified)`, ...witnesses].join(", ");
    const history = previous === null
      ? "the first checkpoint this browser saw of it (kept for the next visit)"
      : `consistent with size ${previous.size} seen ${previous.at}`;
    say(row, `verified: signed by the pinned key; ${history}`, "ok");
  } catch (error) {
    const why = error instanceof VerifyError ? error.message : `could not be checked (${error.message})`;
    say(row, `FAILED: ${why}`, "failed");
  }
}

async function checkAll() {
  for (const origin of Object.keys(pins())) rowFor(origin);
  await Promise.all(Array.from(body.querySelectorAll("tr.log"), check));
}

function problem(text) {
  let element = document.getElementById("pin-problem");
  if (element === null) {
    element = document.createElement("p");
    element.id = "pin-problem";
    element.className = "problem";
    element.setAttribute("role", "alert");
    document.getElementById("pin-form").after(element);
  }
  element.textContent = text;
}

async function pinAndCheck(text) {
  try {
    await pin(text);
    problem("");
  } catch (error) {
    problem(`not pinned: ${error.message}`);
    return;
  }
  await checkAll();
}

document.getElementById("pin-form").addEventListener("submit", (event) => {
  event.preventDefault();
  pinAndCheck(document.getElementById("pin-key").value);
});
document.getElementById("pin-served")?.addEventListener("click", (event) => {
  pinAndCheck(event.currentTarget.dataset.key);
});
document.getElementById("forget").addEventListener("click", () => {
  forget();
  window.location.reload();
});
checkAll();
