"""The natural text of the agent class: retrieved passages and code that a model can really copy.

Agent and RAG prompts carry documentation, notes and code, and their copy tasks (quote this passage,
apply this edit) are answered by repeating that text. A body of random words from the word list has
the right length but not the right content: a small instruct model paraphrases it instead of copying
it, so n-gram speculation found a match in only a quarter of such answers' steps. These passages are
original prose in the register of retrieved documents (manuals, policies, notes, release notes) and
short programs with `+` in them for the edit task. Each carries its token count in SmolLM2's
tokenizer (the embedded model's), the count a trace records; tests/bench checks it against that
tokenizer, and for other English BPE tokenizers it is within a few percent. The text is fixed data:
a trace made from a seed is the same on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Passage:
    """One retrieved passage or program, and its length in tokens."""

    text: str
    """The passage as it appears in the prompt (code keeps its newlines and indentation)."""
    num_tokens: int
    """Its token count in SmolLM2's tokenizer, without special tokens."""


PROSE: tuple[Passage, ...] = (
    Passage("The library lends up to twelve books at a time for three weeks. A loan can be renewed twice online "
            "or at the front desk, unless another reader has reserved the book. Late returns cost ten cents a day, "
            "and the fine never exceeds the price of the book.", 54),
    Passage("Before you update the firmware, connect the printer to a power outlet and make sure the paper tray is "
            "empty. The update takes about eight minutes. Do not turn the printer off while the display shows the "
            "progress bar, or the printer may need to be sent back for repair.", 55),
    Passage("Employees who work from home must use the company laptop and connect through the private network. "
            "Customer files may not be stored on personal devices. If a laptop is lost or stolen, report it to the "
            "help desk within one hour so that its access can be blocked.", 53),
    Passage("Version 2.4 adds support for exporting reports as spreadsheets and fixes a bug that caused the search "
            "page to freeze when a query contained a quotation mark. The old export button is removed; use the "
            "share menu instead. Existing links to saved reports keep working.", 52),
    Passage("The train to the airport leaves from platform four every twenty minutes between five in the morning "
            "and midnight. The journey takes thirty-five minutes. Tickets bought on the train cost two euros more "
            "than tickets bought from the machines in the station hall.", 49),
    Passage("To book a meeting room, open the calendar, choose the room and the time, and add the names of the "
            "people you invite. Rooms on the third floor have a video screen. A booking that nobody checks in to "
            "within fifteen minutes is released for others.", 53),
    Passage("The warranty covers defects in materials and workmanship for two years from the date of purchase. It "
            "does not cover damage caused by water, by dropping the device, or by repairs made by anyone other than "
            "an authorized service center. Keep the receipt as proof of the date.", 54),
    Passage("New users receive an email with a link to set their password. The link expires after forty-eight "
            "hours. A password must have at least twelve characters, and it cannot be one of the last five "
            "passwords used on the account.", 46),
    Passage("The clinic is open from eight to four on weekdays and from nine to noon on Saturdays. Patients with an "
            "appointment should arrive ten minutes early and bring their insurance card. Blood tests are done only "
            "in the morning, before breakfast.", 48),
    Passage("When the water tank is empty, the coffee machine stops and the red light blinks. Fill the tank up to "
            "the line marked max, close the lid and press the start button again. Clean the milk pipe with hot water "
            "after every use.", 49),
    Passage("Refunds are paid to the card used for the purchase within five working days after the returned item "
            "reaches our warehouse. Items must be unused and in their original box. Shipping costs are refunded "
            "only when the item arrived damaged or was not the one ordered.", 52),
    Passage("The city council meets on the first Monday of every month at seven in the evening. Residents may speak "
            "for three minutes each at the start of the meeting if they sign the list at the entrance. The minutes "
            "are published on the website within a week.", 50),
    Passage("The service stores each backup for thirty days. Backups run every night at two o'clock and take less "
            "than an hour for most accounts. To restore a file, open the backup page, pick the date, and select the "
            "folders you want to copy back.", 53),
    Passage("Visitors to the museum may take photographs without flash in the permanent collection. Large bags must "
            "be left in the lockers on the ground floor. Guided tours in English start at eleven and at three, and "
            "they last about an hour.", 47),
    Passage("Our support team answers questions by chat from eight in the morning to eight in the evening, seven "
            "days a week. Outside those hours, leave a message with your order number and we will reply the next "
            "morning. Urgent safety issues can be reported by phone at any time.", 55),
    Passage("The bike rental costs three euros for the first half hour and one euro for every fifteen minutes after "
            "that. Bikes can be returned to any station in the city. If a station is full, the app shows the "
            "nearest one with a free place.", 50),
    Passage("The school year has three terms. The first term starts in early September and ends before the winter "
            "holiday; the second runs from January to Easter; the third ends in late June. Parents meet the "
            "teachers once a term to discuss progress.", 47),
    Passage("Each team writes a short report at the end of the sprint. The report lists the work that was finished, "
            "the work that moved to the next sprint, and the problems that slowed the team down. Reports are "
            "shared in the project folder on Friday afternoon.", 51),
    Passage("The heating in the building is switched on from the middle of October to the end of April. Tenants "
            "who find a radiator cold should first open the small valve at its top until water appears, and then "
            "call the caretaker if it is still cold the next day.", 54),
    Passage("To change the delivery address of an order, sign in, open the order and choose edit address. This is "
            "possible until the order is packed, usually within two hours of payment. After that, the courier can "
            "only deliver to the address on the label.", 52),
    Passage("The conference room can hold forty people seated at tables or sixty in rows of chairs. It has a "
            "projector, two microphones and a whiteboard. Food may be served at the back of the room, but not "
            "near the equipment.", 45),
    Passage("Seeds should be planted in spring after the last frost, about two centimeters deep and a hand apart. "
            "Water them every second day until the first leaves appear, then once a week. The plants need at least "
            "six hours of sunlight a day.", 49),
    Passage("The parking garage under the office has two hundred places. Staff park on levels one and two; levels "
            "three and four are for visitors, who get a ticket at the gate and have it stamped at the reception "
            "desk before they leave.", 46),
    Passage("If the application shows the message disk full, delete the files in the temporary folder and empty "
            "the trash. The cache can also be cleared from the settings page. Logs older than ninety days are "
            "removed automatically every night.", 44),
)
"""Passages for the session's retrieved documents and for the quote task."""

INSTRUCTIONS: tuple[Passage, ...] = (
    Passage("You are the support assistant of a software company. You answer questions from customers and from "
            "colleagues, using the documents that are retrieved for each conversation. When the documents do not "
            "contain the answer, say so and suggest who could help.", 46),
    Passage("You can call three tools. The search tool takes a query and returns the five most relevant passages "
            "from the company's documentation. The ticket tool opens a support ticket with a title, a priority and "
            "a description. The calendar tool lists free slots for a meeting.", 52),
    Passage("When a user asks you to quote a document, copy the passage exactly as it is written, word for word, "
            "without adding a summary or an introduction. When a user asks you to change code, return the whole "
            "program with the change applied and nothing else changed.", 53),
    Passage("Answer in the language of the question. Keep answers short: a few sentences for a simple question, a "
            "numbered list for a procedure. Never invent prices, dates or phone numbers; take them from the "
            "documents or leave them out.", 46),
    Passage("Personal data such as addresses, phone numbers and card numbers must not be repeated in an answer "
            "unless the user gave them in the same conversation. If a user asks for another person's data, refuse "
            "politely and explain that you cannot share it.", 48),
    Passage("When you fill in a form or a JSON object, keep every key in the order given, fill each value from the "
            "documents, and write an empty string for a value you cannot find. Return only the object, with no "
            "explanation before or after it.", 51),
)
"""The system prompt shared by all agent traffic: the assistant's instructions and tools, in order."""

CODE: tuple[Passage, ...] = (
    Passage("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
            "        subtotal = subtotal + item.price * item.quantity\n    return subtotal + subtotal * tax_rate", 48),
    Passage("def next_position(x, y, dx, dy):\n    new_x = x + dx\n    new_y = y + dy\n"
            "    return new_x, new_y", 38),
    Passage("def running_sums(values):\n    sums = []\n    current = 0\n    for value in values:\n"
            "        current = current + value\n        sums.append(current)\n    return sums", 39),
    Passage("def pad_width(text, margin):\n    width = len(text) + 2 * margin\n    border = '+' * width\n"
            "    return border + '\\n' + ' ' * margin + text", 42),
    Passage("def end_time(start_minutes, duration, pause):\n    end = start_minutes + duration + pause\n"
            "    hours = end // 60\n    minutes = end % 60\n    return hours, minutes", 44),
    Passage("def merge_counts(first, second):\n    merged = dict(first)\n    for key, count in second.items():\n"
            "        merged[key] = merged.get(key, 0) + count\n    return merged", 46),
    Passage("def area_with_frame(width, height, frame):\n    outer_width = width + 2 * frame\n"
            "    outer_height = height + 2 * frame\n    return outer_width * outer_height", 44),
    Passage("def average(numbers):\n    total = 0\n    for number in numbers:\n        total = total + number\n"
            "    return total / (len(numbers) + 1e-9)", 38),
)
"""Programs for the edit task (every `+` to become `-`): the answer repeats each of them almost whole."""

FIELDS: tuple[Passage, ...] = (
    Passage("name", 4), Passage("email", 4), Passage("phone", 4), Passage("city", 4), Passage("country", 4),
    Passage("street", 4), Passage("postal_code", 7), Passage("company", 4), Passage("title", 4),
    Passage("department", 4), Passage("start_date", 6), Passage("end_date", 6), Passage("order_id", 6),
    Passage("amount", 4), Passage("currency", 4), Passage("status", 4), Passage("priority", 4),
    Passage("owner", 4), Passage("due_date", 6), Passage("language", 4), Passage("notes", 4),
    Passage("quantity", 4), Passage("product", 4), Passage("category", 4), Passage("room", 4),
    Passage("floor", 4), Passage("opening_hours", 6), Passage("price", 4),
)
"""JSON keys for the fill task; num_tokens is that of the entry ` "key": "",` in an object."""
